"""The gateway's one way to Triton: the kit's async SDK over gRPC (one channel, its retry budget),
its MicroBatcher for one-text requests, an in-flight limit, and the readiness canary behind /ready.
Every call asks the text endpoint for its token counts (usage), its timings (the x-*-time headers) and
cuts the side the request names (truncation_direction): the gateway tokenizes nothing."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from bge_triton.client import AsyncEmbeddingClient, MicroBatcher, RetryPolicy, Timing
from bge_triton.errors import KitError, ModelConfigError
from bge_triton.gateway.errors import overloaded
from bge_triton.gateway.settings import GatewaySettings

__all__ = ["Backend", "TritonBackend", "stop_task"]

log = logging.getLogger("bge_triton.gateway")
CANARY_TEXT = "ready"
Row = tuple[NDArray[Any], int, Timing | None]  # one text's answer through the MicroBatcher


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task (a canary) and wait until it has ended; None: nothing to stop."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Backend(Protocol):
    """What the HTTP layer needs from Triton (a fake one serves the unit tests)."""

    last_error: str

    @property
    def dim(self) -> int: ...
    @property
    def max_length(self) -> int: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def cuts_start(self) -> bool: ...  # the text endpoint cuts either side and reports timing_us

    async def connect(self) -> None: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def embed(self, texts: list[Any], *, priority: int, truncate: bool,
                    direction: str = "right") -> tuple[NDArray[Any], NDArray[Any], Timing | None]: ...
    def ready(self) -> bool: ...


class TritonBackend:
    """AsyncEmbeddingClient to the text endpoint; admission by a counter of requests at Triton."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        retry = RetryPolicy(max_attempts=settings.triton_attempts, total_s=settings.timeout_s)
        self.client = AsyncEmbeddingClient(settings.triton, model=settings.model, timeout_s=settings.timeout_s,
                                           retry=retry, query_instruction=None)
        self.in_flight = 0
        self.last_ok = float("-inf")
        self.last_error = "no canary has run yet"
        self._canary: asyncio.Task[None] | None = None
        self._batchers: dict[tuple[int, bool, str], MicroBatcher[Row]] = {}  # (priority, truncate, direction) -> one

    @property
    def dim(self) -> int:
        return self.client.spec.dim

    @property
    def max_length(self) -> int:
        return self.client.spec.max_length or 512

    @property
    def max_batch(self) -> int:
        return self.client.spec.max_batch_size

    @property
    def cuts_start(self) -> bool:
        return self.client.spec.timings

    async def connect(self) -> None:
        """Read the model's config once (dim, max_length); KitError while Triton is down, ModelConfigError
        for a text endpoint without the `token_count` output that usage comes from."""
        await self.client.connect()
        if not self.client.spec.token_counts:
            raise ModelConfigError(f"the text endpoint '{self.settings.model}' has no 'token_count' output, which "
                                   "the gateway reports as usage: deploy the kit's current model_repository/"
                                   "bge_large_zh (config.pbtxt and 1/*.py) to Triton")

    async def start(self) -> None:
        """Start the canary (it connects, and keeps trying while Triton is down: /ready says so)."""
        if self._canary is None:
            self._canary = asyncio.create_task(self._canary_loop())

    async def close(self) -> None:
        await stop_task(self._canary)
        self._canary = None
        for batcher in self._batchers.values():
            await batcher.aclose(timeout_s=5.0)
        self._batchers.clear()
        await self.client.aclose()

    async def _call(self, texts: Sequence[Any], priority: int, truncate: bool, direction: str
                    ) -> tuple[NDArray[Any], NDArray[Any], Timing | None]:
        """One SDK call: vectors, counts, and the endpoint's timings where it reports them."""
        if self.cuts_start:
            return await self.client.embed_with_timing(texts, truncate=truncate, priority=priority,
                                                       truncation_direction=direction)
        if direction != "right":
            raise ModelConfigError("the text endpoint does not read truncation_direction (too old for truncate START)")
        vectors, counts = await self.client.embed_with_counts(texts, truncate=truncate, priority=priority)
        return vectors, counts, None

    def _batcher(self, priority: int, truncate: bool, direction: str) -> MicroBatcher[Row]:
        """The MicroBatcher of one (priority, truncate, direction): only texts Triton treats alike share a call."""
        key = (priority, truncate, direction)
        batcher = self._batchers.get(key)
        if batcher is None:
            async def embed(texts: Sequence[str]) -> list[Row]:
                vectors, counts, timing = await self._call(texts, priority, truncate, direction)
                return [(v, c, timing) for v, c in zip(vectors, counts.tolist(), strict=True)]  # one row per caller

            batcher = self._batchers[key] = MicroBatcher(
                embed, max_batch=min(32, self.client.spec.max_batch_size), max_wait_s=self.settings.micro_batch_wait_s,
                max_queue=self.settings.max_in_flight, max_in_flight=4)
        return batcher

    async def embed(self, texts: list[Any], *, priority: int, truncate: bool,
                    direction: str = "right") -> tuple[NDArray[Any], NDArray[Any], Timing | None]:
        """float32 [n, dim], int32 [n] token counts and the endpoint's timings; overloaded at once (no queueing
        here) while --max-in-flight requests are at Triton."""
        if self.in_flight >= self.settings.max_in_flight:
            raise overloaded(f"The gateway has {self.in_flight} requests at the model (--max-in-flight "
                             f"{self.settings.max_in_flight}); retry after {self.settings.retry_after_s} s",
                             self.settings.retry_after_s)
        shared = len(texts) == 1 and self.settings.micro_batch and self.in_flight > 0  # alone: no batcher hop
        self.in_flight += 1
        try:
            if shared:
                row = await self._batcher(priority, truncate, direction).embed(texts[0])
                out = row[0][None, :], np.array([row[1]], dtype=np.int32), row[2]
            else:
                out = await self._call(texts, priority, truncate, direction)
        finally:
            self.in_flight -= 1
        self.last_ok = time.monotonic()
        return out

    def ready(self) -> bool:
        """An embedding (canary or real) went through Triton within --ready-max-age seconds."""
        return time.monotonic() - self.last_ok <= self.settings.ready_max_age_s

    async def _canary_loop(self) -> None:
        s = self.settings
        while True:
            started = time.monotonic()
            try:
                await self.connect()  # a text endpoint without token_count keeps /ready at 503, naming it
                # At the passages' priority: a query opens the text endpoint's query mode for query_window_s
                # (1 s), which caps bulk sub-batches and runs them one at a time - a canary every second at the
                # query level kept it open for good and halved the server's bulk throughput (SDK callers at
                # saturation, zero-cost encoder: 1690 vs 3510 texts/s). Under load real answers keep /ready up.
                await self.client.embed_documents([CANARY_TEXT], priority=s.passage_priority,
                                                  timeout_s=min(s.ready_max_age_s, s.timeout_s))
                self.last_ok = time.monotonic()
            except KitError as exc:
                if self.ready() or self.last_error != str(exc):
                    log.warning("canary embedding failed: %s", exc)
                self.last_error = str(exc)
            await asyncio.sleep(max(0.0, s.canary_interval_s - (time.monotonic() - started)))

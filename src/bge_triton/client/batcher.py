"""MicroBatcher: coalesce many concurrent single-text callers of one asyncio process into batches.

The seed design (max batch + max wait) with its flaws fixed:
- work-conserving: when nothing is in flight a text is sent AT ONCE (no idle wait); the max_wait
  window only applies while another batch is already in flight;
- bounded queue with backpressure: callers wait for room (or get Overloaded after queue_timeout_s);
- cancellation-safe: a cancelled caller's text is dropped if still queued, its result discarded
  if in flight; nobody else notices;
- graceful aclose(): stops intake, sends everything queued, waits for in-flight batches;
- error fan-out: a batch's error reaches exactly that batch's callers; an InputError from a batch
  is narrowed down by resending its texts one by one, so only the bad text's caller gets it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from bge_triton.client.core import prepare_texts
from bge_triton.client.errors import InputError, KitError, Overloaded

__all__ = ["MicroBatcher"]

Row = TypeVar("Row")  # what embed_fn answers per text: a vector, or e.g. (vector, tokens)
EmbedFn = Callable[[Sequence[str]], Awaitable[Sequence[Row]]]  # one row per text, in order


@dataclasses.dataclass
class _Item(Generic[Row]):
    text: str
    future: asyncio.Future[Row]
    enqueued: float


class MicroBatcher(Generic[Row]):
    """`await batcher.embed(text)` -> the text's row of `embed_fn(texts)` (the function that sends each
    batch): a float32 [dim] vector for the SDK's embed_documents."""

    def __init__(self, embed_fn: EmbedFn[Row], *, max_batch: int = 32, max_wait_s: float = 0.005,
                 max_queue: int = 1024, max_in_flight: int = 2, queue_timeout_s: float | None = None,
                 isolate_input_errors: bool = True) -> None:
        if max_batch < 1 or max_queue < 1 or max_in_flight < 1 or max_wait_s < 0:
            raise InputError(f"MicroBatcher(max_batch={max_batch}, max_queue={max_queue}, max_in_flight="
                             f"{max_in_flight}, max_wait_s={max_wait_s}): counts must be >= 1, wait >= 0")
        self._embed_fn = embed_fn
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_s, max_queue
        self.max_in_flight, self.queue_timeout_s = max_in_flight, queue_timeout_s
        self.isolate_input_errors = isolate_input_errors
        self._pending: collections.deque[_Item[Row]] = collections.deque()
        self._space: asyncio.Semaphore | None = None
        self._changed: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        self._closing = False
        self.batch_sizes: collections.Counter[int] = collections.Counter()

    # -- caller side ------------------------------------------------------------------------
    async def embed(self, text: str) -> Row:
        """Embed one text through the shared batches; raises what the text's batch raised."""
        prepare_texts([text])  # an invalid text fails its own caller only, before queueing
        self._start()
        assert self._space is not None and self._changed is not None
        if self._closing or (self._runner is not None and self._runner.done()):
            raise KitError("MicroBatcher is closed; create a new one (or embed before aclose())")
        try:
            await asyncio.wait_for(self._space.acquire(), self.queue_timeout_s)
        except asyncio.TimeoutError:
            raise Overloaded(f"MicroBatcher queue full ({self.max_queue} texts waited {self.queue_timeout_s}s); "
                             "raise max_queue / queue_timeout_s or slow the callers") from None
        if self._closing:
            self._space.release()
            raise KitError("MicroBatcher closed while this text waited for room; create a new one")
        loop = asyncio.get_running_loop()
        item: _Item[Row] = _Item(text, loop.create_future(), loop.time())
        self._pending.append(item)
        self._changed.set()
        return await item.future  # cancelling the caller cancels the future: dropped or discarded

    __call__ = embed

    @property
    def queued(self) -> int:
        """Texts waiting (cancelled ones included until the dispatcher drops them)."""
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        """Batches sent and not yet answered."""
        return self._in_flight

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Stop intake, send what is queued, wait for in-flight batches; after timeout_s, cancel them."""
        self._closing = True
        if self._runner is None:
            return
        assert self._changed is not None
        self._changed.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._runner), timeout_s)
        except asyncio.TimeoutError:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    async def __aenter__(self) -> MicroBatcher[Row]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- dispatcher -------------------------------------------------------------------------
    def _start(self) -> None:
        if self._runner is None:
            self._space = asyncio.Semaphore(self.max_queue)
            self._changed = asyncio.Event()
            self._runner = asyncio.get_running_loop().create_task(self._run(), name="MicroBatcher")

    def _drop_cancelled(self) -> None:
        assert self._space is not None
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
            self._space.release()

    def _take(self) -> list[_Item[Row]]:
        assert self._space is not None
        batch: list[_Item[Row]] = []
        while self._pending and len(batch) < self.max_batch:
            item = self._pending.popleft()
            self._space.release()
            if not item.future.done():
                batch.append(item)
        return batch

    async def _run(self) -> None:
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._changed.clear()
                self._drop_cancelled()
                if not self._pending:
                    if self._closing:
                        break
                    await self._changed.wait()
                    continue
                if self._in_flight >= self.max_in_flight:
                    await self._changed.wait()
                    continue
                if self._in_flight and len(self._pending) < self.max_batch and not self._closing:
                    wait = self._pending[0].enqueued + self.max_wait_s - loop.time()
                    if wait > 0:  # busy: let the batch fill for up to max_wait after its oldest text
                        try:
                            await asyncio.wait_for(self._changed.wait(), wait)
                        except asyncio.TimeoutError:
                            pass
                        continue
                batch = self._take()
                if batch:
                    self._in_flight += 1
                    self.batch_sizes[len(batch)] += 1
                    task = loop.create_task(self._dispatch(batch))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        except BaseException:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            err = KitError("MicroBatcher was closed before this text was answered; retry on a new batcher")
            while self._pending:
                item = self._pending.popleft()
                if not item.future.done():
                    item.future.set_exception(err)
            raise

    async def _dispatch(self, batch: list[_Item[Row]]) -> None:
        assert self._changed is not None
        try:
            try:
                vectors = await self._embed_fn([item.text for item in batch])
                if len(vectors) != len(batch):
                    raise KitError(f"embed_fn returned {len(vectors)} rows for {len(batch)} texts")
            except InputError as exc:
                if len(batch) > 1 and self.isolate_input_errors:
                    await asyncio.gather(*(self._dispatch_one(item) for item in batch))
                else:
                    _fail(batch, exc)
            except asyncio.CancelledError:
                err = KitError("MicroBatcher was closed while this text was in flight; retry on a new batcher")
                _fail(batch, err)
                raise
            except Exception as exc:  # handed to exactly this batch's callers
                _fail(batch, exc)
            else:
                for item, vector in zip(batch, vectors, strict=True):
                    if not item.future.done():
                        item.future.set_result(vector)
        finally:
            self._in_flight -= 1
            self._changed.set()

    async def _dispatch_one(self, item: _Item[Row]) -> None:
        if item.future.done():
            return
        try:
            vector = (await self._embed_fn([item.text]))[0]
        except Exception as exc:  # this caller's own error
            _fail([item], exc)
        else:
            if not item.future.done():
                item.future.set_result(vector)

    def stats(self) -> dict[str, Any]:
        """Batches sent and their sizes (for benchmarks and tests)."""
        batches = sum(self.batch_sizes.values())
        texts = sum(size * count for size, count in self.batch_sizes.items())
        return {"batches": batches, "texts": texts, "mean_batch": texts / batches if batches else 0.0,
                "sizes": dict(sorted(self.batch_sizes.items()))}


def _fail(batch: Sequence[_Item[Any]], exc: BaseException) -> None:
    for item in batch:
        if not item.future.done():
            item.future.set_exception(exc)

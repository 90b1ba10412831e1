"""AsyncEmbeddingClient: the asyncio client (`async with`), over gRPC (default) or HTTP."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bge_triton.client.base import BaseEmbeddingClient
from bge_triton.client.core import CANARY_TEXT, Embedded, InferCall, Timed, Utf8
from bge_triton.client.errors import classify
from bge_triton.client.rerank import Ranked, Reranked, decode_scores, ranked, rerank_calls
from bge_triton.client.retry import acall_with_retry
from bge_triton.client.transport import make_async_transport

__all__ = ["AsyncEmbeddingClient"]


class AsyncEmbeddingClient(BaseEmbeddingClient):
    """Asyncio embeddings client; same arguments and results as EmbeddingClient.

    >>> async with AsyncEmbeddingClient("127.0.0.1:8001") as c:
    ...     vectors = await c.embed_documents(["文本一", "文本二"])

    Requests of one call that exceed max_batch_size are sent concurrently. `transport` (as httpx's): the adapter
    the client sends through until close() (model_config, infer, ready, close; default
    client.transport.make_async_transport(settings)); a wrapper around the default can watch each attempt.
    """

    def __init__(self, url: str | None = None, model: str = "bge_large_zh", protocol: str = "grpc",
                 mode: str = "text", *, transport: Any = None, **kwargs: Any) -> None:
        super().__init__(url, model, protocol, mode, **kwargs)
        self._transport: Any = transport
        self._connect_lock: asyncio.Lock | None = None

    # -- connection -------------------------------------------------------------------------
    async def connect(self) -> AsyncEmbeddingClient:
        """Open the transport, read the server's model config and check it (ModelConfigError on mismatch)."""
        if self._spec is not None:
            return self
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._spec is not None:
                return self
            self._transport = self._transport or make_async_transport(self.settings)
            target, where, text_model = self._config_targets()
            config = await acall_with_retry(lambda t: self._transport.model_config(target, t),
                                            self.settings.retry, self.settings.timeout_s, where)
            text_endpoint = None
            if text_model is not None:
                try:
                    text_endpoint = await self._transport.model_config(text_model, self.settings.timeout_s)
                except Exception:
                    text_endpoint = None
            self._accept_config(config, text_endpoint)
        return self

    async def aclose(self) -> None:
        """Close the transport; the client can connect() again afterwards."""
        if self._transport is not None:
            transport, self._transport = self._transport, None
            await transport.close()
        self._spec = None

    close = aclose

    async def __aenter__(self) -> AsyncEmbeddingClient:
        try:
            return await self.connect()
        except BaseException:
            await self.aclose()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- embeddings -------------------------------------------------------------------------
    async def embed_documents(self, texts: Sequence[str], *, timeout_s: float | None = None,
                              truncate: bool | None = None, priority: int = 0) -> NDArray[Any]:
        """Embed passages: float32 [n, dim], L2-normalised, in input order.

        priority: Triton priority level of the requests (1 = highest; 0 = the model's default level)."""
        return (await self._embed(texts, False, timeout_s, truncate, priority))[0]

    async def embed_queries(self, texts: Sequence[str], *, timeout_s: float | None = None,
                            truncate: bool | None = None, priority: int = 0) -> NDArray[Any]:
        """Embed search queries (the query instruction prepended): float32 [n, dim]."""
        return (await self._embed(texts, True, timeout_s, truncate, priority))[0]

    async def embed_with_counts(self, texts: Sequence[str], *, query: bool = False, timeout_s: float | None = None,
                                truncate: bool | None = None, priority: int = 0) -> Embedded:
        """Embeddings and each text's token count as the model embedded it (Embedded(vectors, token_counts)):
        usage accounting with the server's own tokenizer and no tokenizing here. ModelConfigError if the
        text endpoint does not declare its `token_count` output."""
        vectors, counts, _ = await self._embed(texts, query, timeout_s, truncate, priority, counts=True)
        assert counts is not None
        return Embedded(vectors, counts)

    async def embed_with_timing(self, texts: Sequence[str | Utf8], *, query: bool = False,
                                timeout_s: float | None = None, truncate: bool | None = None, priority: int = 0,
                                truncation_direction: str | None = None) -> Timed:
        """embed_with_counts plus where the time went (Timed(vectors, token_counts, timing)): the text endpoint's
        tokenization, queue and inference seconds and this call's total. truncation_direction "left" keeps a
        too-long text's end (the endpoint cuts the start), "right" (the default) its start. ModelConfigError if
        the text endpoint does not declare `timing_us` (the same release reads truncation_direction)."""
        start = time.perf_counter()
        vectors, counts, timing = await self._embed(texts, query, timeout_s, truncate, priority, counts=True,
                                                    direction=truncation_direction, timing=True)
        assert counts is not None and timing is not None
        return Timed(vectors, counts, self._timing(timing, time.perf_counter() - start))

    async def _one(self, call: InferCall, timeout: float) -> tuple[NDArray[Any], NDArray[Any] | None, Any]:
        s = self.settings
        where = f"infer '{call.model}' ({call.rows} texts) at {s.url}"
        result = await acall_with_retry(lambda t: self._transport.infer(call, t), s.retry, timeout, where,
                                       budget=self._retry_budget)
        return (*self._decode(call, result), self._decode_timing(call, result))

    async def _embed(self, texts: Sequence[str | Utf8], query: bool, timeout_s: float | None,
                     truncate: bool | None, priority: int = 0, counts: bool = False, direction: str | None = None,
                     timing: bool = False) -> tuple[NDArray[Any], NDArray[Any] | None, list[Any] | None]:
        await self.connect()
        timeout = self.settings.timeout_s if timeout_s is None else timeout_s
        n, plan = self._plan(texts, query, truncate, counts, direction, timing)
        if priority:  # Triton's queue priority, and the same level for the text endpoint's scheduler: the python
            # backend cannot read a request's Triton priority, and Triton reserves the parameter name "priority"
            plan = [(dataclasses.replace(call, priority=int(priority), parameters={**call.parameters,
                                                                                   "priority_level": int(priority)}),
                     idx) for call, idx in plan]
        if len(plan) == 1:
            results = [await self._one(plan[0][0], timeout)]
        else:
            tasks = [asyncio.ensure_future(self._one(call, timeout)) for call, _ in plan]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # one request failed (or we were cancelled): stop the others
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        vectors = self._assemble(n, [(idx, emb) for (_, idx), (emb, _, _) in zip(plan, results, strict=True)])
        timings = [t for _, _, t in results] if timing else None
        if not counts:
            return vectors, None, timings
        row_counts = [(idx, c) for (_, idx), (_, c, _) in zip(plan, results, strict=True) if c is not None]
        return vectors, self._assemble_counts(n, row_counts), timings

    # -- rerank -----------------------------------------------------------------------------
    async def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None, *,
                     model: str | None = None, timeout_s: float | None = None, truncate: bool | None = None,
                     truncation_direction: str | None = None, priority: int = 0) -> list[Ranked]:
        """Rank documents by relevance to the query: [Ranked(index, score, logit)], highest score first; see
        EmbeddingClient.rerank. Requests of one call (over 1000 documents) are sent concurrently."""
        return (await self.rerank_with_timing(query, documents, top_n, model=model, timeout_s=timeout_s,
                                              truncate=truncate, truncation_direction=truncation_direction,
                                              priority=priority)).results

    async def rerank_with_timing(self, query: str, documents: Sequence[str], top_n: int | None = None, *,
                                 model: str | None = None, timeout_s: float | None = None,
                                 truncate: bool | None = None, truncation_direction: str | None = None,
                                 priority: int = 0) -> Reranked:
        """rerank plus the tokens of every pair as scored and where the time went (Reranked)."""
        s = self.settings
        start = time.perf_counter()
        self._transport = self._transport or make_async_transport(s)
        timeout = s.timeout_s if timeout_s is None else timeout_s
        calls = rerank_calls(model or s.rerank_model, query, documents, s.truncate if truncate is None else truncate,
                             truncation_direction, priority, timing=True, timeout_s=timeout)

        async def one(call: InferCall) -> Any:
            where = f"rerank '{call.model}' ({call.rows} documents) at {s.url}"
            result = await acall_with_retry(lambda t: self._transport.infer(call, t), s.retry, timeout, where,
                                           budget=self._retry_budget)
            return (*decode_scores(result, call.rows), self._decode_timing(call, result))

        tasks = [asyncio.ensure_future(one(call)) for call, _ in calls]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        logits = np.empty(len(documents), np.float32)
        for (_, part), (values, _, _) in zip(calls, parts, strict=True):
            logits[part] = values
        return Reranked(ranked(logits, top_n), int(sum(int(c.sum()) for _, c, _ in parts)),
                        self._timing([t for _, _, t in parts], time.perf_counter() - start))

    # -- health -----------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        """Server and model readiness, the model's spec and one canary embedding; never raises for a down server."""
        s = self.settings
        report: dict[str, Any] = {"url": s.url, "protocol": s.protocol, "model": s.target_model}
        if self._transport is None:
            self._transport = make_async_transport(s)
        try:
            report["server_ready"] = await self._transport.ready(None, s.timeout_s)
            report["model_ready"] = await self._transport.ready(s.target_model, s.timeout_s)
            await self.connect()
            report.update(dim=self.spec.dim, max_batch_size=self.spec.max_batch_size,
                          parameters=self.spec.parameters)
            start = time.perf_counter()  # a canary: a model whose python stub died still reports ready
            await self.embed_documents([CANARY_TEXT], timeout_s=s.timeout_s, truncate=True)
            report.update(canary_ms=round((time.perf_counter() - start) * 1e3, 2), ok=True)
        except Exception as exc:
            err = classify(exc, "health", s.timeout_s)
            report.update(ok=False, error=f"{type(err).__name__}: {err}")
        report.setdefault("server_ready", False)
        report.setdefault("model_ready", False)
        return report

    def micro_batcher(self, *, query: bool = False, **kwargs: Any) -> MicroBatcher[NDArray[Any]]:
        """A MicroBatcher over embed_documents (or embed_queries) of this client; see client.batcher."""
        from bge_triton.client.batcher import MicroBatcher

        fn = self.embed_queries if query else self.embed_documents
        if self._spec is not None:
            kwargs["max_batch"] = min(kwargs.get("max_batch", 32), self._spec.max_batch_size)
        return MicroBatcher(fn, **kwargs)  # type: ignore[arg-type]  # an array is a Sequence of rows


from bge_triton.client.batcher import MicroBatcher  # noqa: E402  (type name for the annotation above)

"""EmbeddingClient: the blocking client (a context manager), over gRPC (default) or HTTP."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bge_triton.client.base import BaseEmbeddingClient
from bge_triton.client.core import CANARY_TEXT, Embedded, Timed, Utf8
from bge_triton.client.errors import classify
from bge_triton.client.rerank import Ranked, decode_scores, ranked, rerank_calls
from bge_triton.client.retry import call_with_retry
from bge_triton.client.transport import make_sync_transport

__all__ = ["EmbeddingClient"]


class EmbeddingClient(BaseEmbeddingClient):
    """Blocking embeddings client.

    >>> with EmbeddingClient("127.0.0.1:8001", model="bge_large_zh") as c:
    ...     vectors = c.embed_documents(["文本一", "文本二"])   # float32 [2, 1024]

    Thread-safe: gRPC calls run side by side on one channel; HTTP calls take turns on one keep-alive
    connection (use gRPC, or one client per thread, for many calls in flight). `transport` (as httpx's): the
    adapter the client sends through until close() (model_config, infer, ready, close; default
    client.transport.make_sync_transport(settings)); a wrapper around the default can watch each attempt.
    """

    def __init__(self, url: str | None = None, model: str = "bge_large_zh", protocol: str = "grpc",
                 mode: str = "text", *, transport: Any = None, **kwargs: Any) -> None:
        super().__init__(url, model, protocol, mode, **kwargs)
        self._transport: Any = transport

    # -- connection -------------------------------------------------------------------------
    def connect(self) -> EmbeddingClient:
        """Open the transport, read the server's model config and check it (ModelConfigError on mismatch)."""
        if self._spec is not None:
            return self
        self._transport = self._transport or make_sync_transport(self.settings)
        target, where, text_model = self._config_targets()
        config = call_with_retry(lambda t: self._transport.model_config(target, t),
                                 self.settings.retry, self.settings.timeout_s, where)
        text_endpoint = None
        if text_model is not None:
            try:
                text_endpoint = self._transport.model_config(text_model, self.settings.timeout_s)
            except Exception:
                text_endpoint = None
        self._accept_config(config, text_endpoint)
        return self

    def close(self) -> None:
        """Close the transport; the client can connect() again afterwards."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._spec = None

    def __enter__(self) -> EmbeddingClient:
        try:
            return self.connect()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- embeddings -------------------------------------------------------------------------
    def embed_documents(self, texts: Sequence[str], *, timeout_s: float | None = None,
                        truncate: bool | None = None) -> NDArray[Any]:
        """Embed passages: float32 [n, dim], L2-normalised, in input order."""
        return self._embed(texts, query=False, timeout_s=timeout_s, truncate=truncate)[0]

    def embed_queries(self, texts: Sequence[str], *, timeout_s: float | None = None,
                      truncate: bool | None = None) -> NDArray[Any]:
        """Embed search queries (the query instruction prepended): float32 [n, dim]."""
        return self._embed(texts, query=True, timeout_s=timeout_s, truncate=truncate)[0]

    def embed_with_counts(self, texts: Sequence[str], *, query: bool = False, timeout_s: float | None = None,
                          truncate: bool | None = None) -> Embedded:
        """Embeddings and each text's token count as the model embedded it (Embedded(vectors, token_counts));
        ModelConfigError if the text endpoint does not declare its `token_count` output."""
        vectors, counts = self._embed(texts, query=query, timeout_s=timeout_s, truncate=truncate, counts=True)
        assert counts is not None
        return Embedded(vectors, counts)

    def embed_with_timing(self, texts: Sequence[str | Utf8], *, query: bool = False, timeout_s: float | None = None,
                          truncate: bool | None = None, truncation_direction: str | None = None) -> Timed:
        """embed_with_counts plus where the time went (Timed(vectors, token_counts, timing)); see
        AsyncEmbeddingClient.embed_with_timing."""
        start = time.perf_counter()
        timings: list[Any] = []
        vectors, counts = self._embed(texts, query=query, timeout_s=timeout_s, truncate=truncate, counts=True,
                                      direction=truncation_direction, timings=timings)
        assert counts is not None
        return Timed(vectors, counts, self._timing(timings, time.perf_counter() - start))

    def _embed(self, texts: Sequence[str | Utf8], query: bool, timeout_s: float | None,
               truncate: bool | None, counts: bool = False, direction: str | None = None,
               timings: list[Any] | None = None) -> tuple[NDArray[Any], NDArray[Any] | None]:
        """The vectors (and counts); with a `timings` list, also each request's `timing_us` appended to it."""
        self.connect()
        s = self.settings
        timeout = s.timeout_s if timeout_s is None else timeout_s
        n, plan = self._plan(texts, query, truncate, counts, direction, timings is not None)
        parts: list[tuple[NDArray[Any], NDArray[Any]]] = []
        count_parts: list[tuple[NDArray[Any], NDArray[Any]]] = []
        for call, idx in plan:
            where = f"infer '{call.model}' ({call.rows} texts) at {s.url}"

            def infer(t: float, c: Any = call) -> Any:
                return self._transport.infer(c, t)

            result = call_with_retry(infer, s.retry, timeout, where, budget=self._retry_budget)
            vectors, row_counts = self._decode(call, result)
            if timings is not None:
                timings.append(self._decode_timing(call, result))
            parts.append((idx, vectors))
            if row_counts is not None:
                count_parts.append((idx, row_counts))
        return self._assemble(n, parts), self._assemble_counts(n, count_parts) if counts else None

    # -- rerank -----------------------------------------------------------------------------
    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None, *, model: str | None = None,
               timeout_s: float | None = None, truncate: bool | None = None,
               truncation_direction: str | None = None, priority: int = 0) -> list[Ranked]:
        """Rank documents by relevance to the query with the reranker (default settings.rerank_model):
        [Ranked(index, score, logit)], highest score first; score = sigmoid(logit). Over max_length the document
        is cut (truncation_direction: its end, default, or start), never the query; truncate=False refuses it."""
        s = self.settings
        self._transport = self._transport or make_sync_transport(s)
        timeout = s.timeout_s if timeout_s is None else timeout_s
        calls = rerank_calls(model or s.rerank_model, query, documents, s.truncate if truncate is None else truncate,
                             truncation_direction, priority, timeout_s=timeout)
        logits = np.empty(len(documents), np.float32)
        for call, part in calls:
            where = f"rerank '{call.model}' ({call.rows} documents) at {s.url}"

            def infer(t: float, c: Any = call) -> Any:
                return self._transport.infer(c, t)

            logits[part] = decode_scores(call_with_retry(infer, s.retry, timeout, where, budget=self._retry_budget),
                                         call.rows)[0]
        return ranked(logits, top_n)

    # -- health -----------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Server and model readiness, the model's spec and one canary embedding; never raises for a down server."""
        s = self.settings
        report: dict[str, Any] = {"url": s.url, "protocol": s.protocol, "model": s.target_model}
        if self._transport is None:
            self._transport = make_sync_transport(s)
        try:
            report["server_ready"] = self._transport.ready(None, s.timeout_s)
            report["model_ready"] = self._transport.ready(s.target_model, s.timeout_s)
            self.connect()
            report.update(dim=self.spec.dim, max_batch_size=self.spec.max_batch_size,
                          parameters=self.spec.parameters)
            start = time.perf_counter()  # a canary: a model whose python stub died still reports ready
            self._embed([CANARY_TEXT], query=False, timeout_s=s.timeout_s, truncate=True)
            report.update(canary_ms=round((time.perf_counter() - start) * 1e3, 2), ok=True)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            err = classify(exc, "health", s.timeout_s)
            report.update(ok=False, error=f"{type(err).__name__}: {err}")
        report.setdefault("server_ready", False)
        report.setdefault("model_ready", False)
        return report

"""BaseEmbeddingClient: the I/O-free half of both clients (the httpx `BaseClient` pattern).

It turns (texts, query?) into a plan of InferCalls - split at the server's max_batch_size, and in
tensor mode sorted by token length so each request pads to a small bucket - and puts the answers
back in input order. EmbeddingClient and AsyncEmbeddingClient only add the I/O.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.client.core import (
    MASK_INPUT,
    TIMING,
    TOKEN_COUNT,
    ClientSettings,
    InferCall,
    ModelSpec,
    Timing,
    Utf8,
    chunk_slices,
    prepare_texts,
    tensor_call,
    text_call,
    validate_model_config,
)
from bge_triton.client.errors import KitError, ModelConfigError
from bge_triton.client.retry import RetryBudget, RetryPolicy
from bge_triton.client.tokens import BucketTokenizer, pad_to_bucket
from bge_triton.client.wire import decode_embeddings, decode_token_counts

__all__ = ["BaseEmbeddingClient", "Plan"]

Plan = list[tuple[InferCall, NDArray[Any]]]  # each request and the input positions of its rows


class BaseEmbeddingClient:
    """Settings, the validated ModelSpec, the tensor-mode tokenizer, and request planning."""

    def __init__(self, url: str | None = None, model: str = "bge_large_zh", protocol: str = "grpc",
                 mode: str = "text", *, timeout_s: float = 10.0, retry: RetryPolicy | None = None,
                 tokenizer: str | None = None, buckets: Sequence[int] | None = None,
                 max_length: int | None = None, truncate: bool = True,
                 query_instruction: str | None = ClientSettings.query_instruction,
                 expected_dim: int | None = None, rerank_model: str = ClientSettings.rerank_model,
                 settings: ClientSettings | None = None) -> None:
        if settings is None:
            extra: dict[str, Any] = {"buckets": tuple(buckets)} if buckets is not None else {}
            settings = ClientSettings(url=url, model=model, protocol=protocol, mode=mode, timeout_s=timeout_s,
                                      retry=retry or RetryPolicy(), tokenizer=tokenizer, max_length=max_length,
                                      truncate=truncate, query_instruction=query_instruction,
                                      expected_dim=expected_dim, rerank_model=rerank_model, **extra)
        self.settings = settings
        self._retry_budget: RetryBudget | None = settings.retry.make_budget()  # shared by the client's calls
        self._spec: ModelSpec | None = None
        self._tokenizer: BucketTokenizer | None = None

    @property
    def spec(self) -> ModelSpec:
        """The server model's validated spec (dim, max_batch_size, ...); needs connect() first."""
        if self._spec is None:
            raise KitError("client is not connected: use it as a context manager or call connect() first")
        return self._spec

    @property
    def dim(self) -> int:
        """Embedding width reported by the server."""
        return self.spec.dim

    @property
    def tokenizer(self) -> BucketTokenizer | None:
        """Tensor mode's bucket tokenizer (None in text mode)."""
        return self._tokenizer

    def _config_targets(self) -> tuple[str, str, str | None]:
        """What connect() reads: the target model, where (for errors), and the text endpoint in tensor mode."""
        s = self.settings
        return s.target_model, f"model config of '{s.target_model}' at {s.url}", \
            (s.model if s.mode == "tensor" else None)

    def _accept_config(self, config: mc.ModelConfig, text_endpoint: mc.ModelConfig | None) -> None:
        """Validate the target model's config; in tensor mode also build the tokenizer."""
        spec = validate_model_config(config, self.settings)
        if self.settings.mode == "tensor":
            max_length = self.settings.max_length
            if max_length is None and text_endpoint is not None:
                value = text_endpoint.parameters.get("max_length")
                max_length = int(value.string_value) if value and value.string_value.isdigit() else None
            assert self.settings.tokenizer is not None  # ClientSettings refuses tensor mode without one
            self._tokenizer = BucketTokenizer(self.settings.tokenizer, self.settings.buckets, max_length)
        self._spec = spec

    def _plan(self, texts: Sequence[str | Utf8], query: bool, truncate: bool | None = None,
              counts: bool = False, direction: str | None = None, timing: bool = False) -> tuple[int, Plan]:
        """Build the requests for one embed call; returns (n, plan). counts / timing: also ask for token counts /
        the endpoint's timings; direction: the side a too-long text loses ("right" = the end, "left" = the start)."""
        s = self.settings
        if counts and not self.spec.token_counts:
            raise ModelConfigError(f"model '{self.spec.name}' does not declare the output 'token_count' (INT32 "
                                   "dims [1]) that token counts come from: deploy the kit's current text endpoint "
                                   "(model_repository/bge_large_zh), or call embed_documents without counts")
        if (timing or direction not in (None, "right")) and not self.spec.timings:
            raise ModelConfigError(f"model '{self.spec.name}' does not declare the output '{TIMING}' (INT64 dims [3]) "
                                   "and with it the request parameter truncation_direction: deploy the kit's current "
                                   "text endpoint (model_repository/bge_large_zh)")
        if direction is not None and s.mode == "tensor":
            raise ModelConfigError("truncation_direction is a text-endpoint parameter: use mode='text'")
        prepared = prepare_texts(texts, s.query_instruction if query else None)
        truncate = s.truncate if truncate is None else truncate
        n, max_batch = len(prepared), self.spec.max_batch_size
        plan: Plan = []
        if s.mode == "text":
            for sl in chunk_slices(n, max_batch):
                plan.append((text_call(self.spec.name, prepared[sl], truncate, counts, direction, timing),
                             np.arange(n)[sl]))
            return n, plan
        assert self._tokenizer is not None
        ids = self._tokenizer.token_ids([t if isinstance(t, str) else t.decode("utf-8") for t in prepared], truncate)
        order = np.argsort([len(x) for x in ids], kind="stable")  # similar lengths share a bucket
        for sl in chunk_slices(n, max_batch):
            idx = order[sl]
            input_ids, mask = pad_to_bucket([ids[i] for i in idx], self._tokenizer.buckets, self._tokenizer.pad_id)
            plan.append((tensor_call(self.spec.name, input_ids, mask), idx))
        return n, plan

    def _decode(self, call: InferCall, result: Any) -> tuple[NDArray[Any], NDArray[Any] | None]:
        """One answer's embeddings, and its token counts where the call asked for them (text mode) or
        sent them (tensor mode: the attention mask's row sums)."""
        vectors = decode_embeddings(result, call.rows, self.spec.dim)
        if self.settings.mode == "tensor":
            mask = next(arr for name, _, arr in call.inputs if name == MASK_INPUT)
            return vectors, mask.sum(axis=1).astype(np.int32)
        return vectors, decode_token_counts(result, call.rows) if TOKEN_COUNT in call.outputs else None

    @staticmethod
    def _decode_timing(call: InferCall, result: Any) -> NDArray[Any] | None:
        """The request's (tokenization, queue, inference) microseconds from `timing_us` (every row the same;
        row 0 is read), where the call asked for it: int64 [3]."""
        if TIMING not in call.outputs:
            return None
        arr = result.as_numpy(TIMING)
        if arr is None or arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] < 1:
            raise KitError(f"response '{TIMING}' is {None if arr is None else arr.shape}, expected ({call.rows}, 3): "
                           "the text endpoint's model.py does not follow its config - redeploy it")
        return np.asarray(arr[0], dtype=np.int64)

    @staticmethod
    def _timing(parts: Sequence[NDArray[Any] | None], total_s: float) -> Timing:
        """One Timing from each request's microseconds: the largest of each part (the requests ran at once)."""
        have = [p for p in parts if p is not None]
        us = np.max(np.stack(have), axis=0) if have else np.zeros(3, dtype=np.int64)
        return Timing(float(us[0]) / 1e6, float(us[1]) / 1e6, float(us[2]) / 1e6, total_s)

    def _assemble(self, n: int, parts: list[tuple[NDArray[Any], NDArray[Any]]]) -> NDArray[Any]:
        """Put each request's rows back at their input positions: float32 [n, dim]."""
        out = np.empty((n, self.spec.dim), dtype=np.float32)
        for idx, emb in parts:
            out[idx] = emb
        return out

    def _assemble_counts(self, n: int, parts: list[tuple[NDArray[Any], NDArray[Any]]]) -> NDArray[Any]:
        """Token counts back at their input positions: int32 [n]."""
        out = np.zeros(n, dtype=np.int32)
        for idx, counts in parts:
            out[idx] = counts
        return out

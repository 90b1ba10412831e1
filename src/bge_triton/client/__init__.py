"""Python SDK for the kit's Triton embedding endpoints: sync and asyncio, gRPC and HTTP, text and
tensor modes, a micro-batcher for many concurrent single-text callers, retries with backoff.

    from bge_triton.client import EmbeddingClient
    with EmbeddingClient("127.0.0.1:8001", model="bge_large_zh") as c:
        vectors = c.embed_documents(["文本一", "文本二"])   # float32 [2, 1024], L2-normalised
"""
from bge_triton.client.aio import AsyncEmbeddingClient
from bge_triton.client.batcher import MicroBatcher
from bge_triton.client.core import (
    BGE_QUERY_INSTRUCTION,
    DEFAULT_BUCKETS,
    ClientSettings,
    ModelSpec,
    Timed,
    Timing,
    Utf8,
)
from bge_triton.client.errors import InputError, KitError, ModelConfigError, Overloaded, ServerUnavailable
from bge_triton.client.rerank import Ranked
from bge_triton.client.retry import RetryBudget, RetryPolicy
from bge_triton.client.sync import EmbeddingClient

__all__ = [
    "EmbeddingClient",
    "AsyncEmbeddingClient",
    "MicroBatcher",
    "Ranked",
    "RetryPolicy",
    "RetryBudget",
    "ClientSettings",
    "ModelSpec",
    "Timing",
    "Timed",
    "Utf8",
    "BGE_QUERY_INSTRUCTION",
    "DEFAULT_BUCKETS",
    "KitError",
    "InputError",
    "ModelConfigError",
    "ServerUnavailable",
    "Overloaded",
]

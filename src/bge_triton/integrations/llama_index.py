"""LlamaIndex `BaseEmbedding` over the kit's SDK (queries get BGE's retrieval instruction).

    from bge_triton.integrations.llama_index import BgeTritonEmbedding
    Settings.embed_model = BgeTritonEmbedding(url="127.0.0.1:8001", model="bge_large_zh")
"""
from __future__ import annotations

from typing import Any

from bge_triton.extras import require

require("llamaindex", "bge_triton.integrations.llama_index")

from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from pydantic import PrivateAttr  # noqa: E402

from bge_triton.integrations._clients import SdkClients  # noqa: E402

__all__ = ["BgeTritonEmbedding"]


class BgeTritonEmbedding(BaseEmbedding):
    """Triton text endpoint as a LlamaIndex embedding model; client_kwargs go to the SDK client."""

    url: str = "127.0.0.1:8001"
    triton_model: str = "bge_large_zh"
    _clients: SdkClients = PrivateAttr()

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "bge_large_zh", embed_batch_size: int = 64,
                 client_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # pydantic fields of this subclass: mypy (no pydantic plugin) sees only BaseEmbedding's
        super().__init__(url=url, triton_model=model,  # type: ignore[call-arg]
                         model_name=kwargs.pop("model_name", model), embed_batch_size=embed_batch_size, **kwargs)
        self._clients = SdkClients(url, model, **(client_kwargs or {}))

    @classmethod
    def class_name(cls) -> str:
        return "BgeTritonEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._clients.sync().embed_queries([query])[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._clients.sync().embed_documents([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._clients.sync().embed_documents(texts).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await (await self._clients.aio()).embed_queries([query]))[0].tolist()

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await (await self._clients.aio()).embed_documents([text]))[0].tolist()

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return (await (await self._clients.aio()).embed_documents(texts)).tolist()

    def close(self) -> None:
        """Close the sync client's channel."""
        self._clients.close()

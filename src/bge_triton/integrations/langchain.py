"""LangChain `Embeddings` over the kit's SDK: embed_documents / embed_query and their async twins.

    from bge_triton.integrations.langchain import BgeTritonEmbeddings
    emb = BgeTritonEmbeddings(url="127.0.0.1:8001", model="bge_large_zh")
    vectorstore = FAISS.from_texts(texts, emb)      # passages; queries get BGE's instruction
"""
from __future__ import annotations

from typing import Any

from bge_triton.extras import require

require("langchain", "bge_triton.integrations.langchain")

from langchain_core.embeddings import Embeddings  # noqa: E402

from bge_triton.integrations._clients import SdkClients  # noqa: E402

__all__ = ["BgeTritonEmbeddings"]


class BgeTritonEmbeddings(Embeddings):
    """Triton text endpoint as LangChain embeddings; kwargs go to the SDK client (protocol, timeout_s,
    retry, query_instruction, truncate, ...)."""

    def __init__(self, url: str | None = "127.0.0.1:8001", model: str = "bge_large_zh", **kwargs: Any) -> None:
        self.clients = SdkClients(url, model, **kwargs)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Passages, as stored in a vector store."""
        return self.clients.sync().embed_documents(texts).tolist() if texts else []

    def embed_query(self, text: str) -> list[float]:
        """One search query (BGE's retrieval instruction prepended by the SDK)."""
        return self.clients.sync().embed_queries([text])[0].tolist()

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return (await (await self.clients.aio()).embed_documents(texts)).tolist()

    async def aembed_query(self, text: str) -> list[float]:
        return (await (await self.clients.aio()).embed_queries([text]))[0].tolist()

    def close(self) -> None:
        """Close the sync client's channel."""
        self.clients.close()

    async def aclose(self) -> None:
        """Close this event loop's async client."""
        await self.clients.aclose()

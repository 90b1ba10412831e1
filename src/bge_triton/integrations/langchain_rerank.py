"""LangChain document compressor over the kit's reranker (the second stage of RAG): keeps the top_n documents by
relevance to the query, best first, each with `relevance_score` in its metadata.

    from langchain.retrievers import ContextualCompressionRetriever
    from bge_triton.integrations.langchain_rerank import BgeTritonRerank
    retriever = ContextualCompressionRetriever(base_compressor=BgeTritonRerank(url="127.0.0.1:8001", top_n=5),
                                               base_retriever=vectorstore.as_retriever(search_kwargs={"k": 50}))
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bge_triton.extras import require

require("langchain", "bge_triton.integrations.langchain_rerank")

from langchain_core.callbacks import Callbacks  # noqa: E402
from langchain_core.documents import BaseDocumentCompressor, Document  # noqa: E402
from pydantic import ConfigDict, PrivateAttr  # noqa: E402

from bge_triton.client import Ranked  # noqa: E402
from bge_triton.integrations._clients import SdkClients  # noqa: E402

__all__ = ["BgeTritonRerank"]


class BgeTritonRerank(BaseDocumentCompressor):
    """The reranker's text-pair endpoint as a LangChain document compressor; client_kwargs go to the SDK client
    (protocol, timeout_s, retry, truncate, ...)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    url: str = "127.0.0.1:8001"
    model: str = "bge_reranker"
    top_n: int | None = 3
    client_kwargs: dict[str, Any] = {}
    _clients: SdkClients = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        self._clients = SdkClients(self.url, "bge_large_zh", rerank_model=self.model, **self.client_kwargs)

    def _pick(self, documents: Sequence[Document], ranked: list[Ranked]) -> list[Document]:
        out = []
        for r in ranked:
            doc = documents[r.index]
            out.append(Document(page_content=doc.page_content, id=doc.id,
                                metadata={**doc.metadata, "relevance_score": r.score}))
        return out

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        """The top_n documents by relevance to the query, best first."""
        if not documents:
            return []
        ranked = self._clients.unchecked().rerank(query, [d.page_content for d in documents], self.top_n)
        return self._pick(documents, ranked)

    async def acompress_documents(self, documents: Sequence[Document], query: str,
                                  callbacks: Callbacks | None = None) -> Sequence[Document]:
        if not documents:
            return []
        client = self._clients.aio_unchecked()
        return self._pick(documents, await client.rerank(query, [d.page_content for d in documents], self.top_n))

    def close(self) -> None:
        """Close the sync client's channel."""
        self._clients.close()

"""LlamaIndex node postprocessor over the kit's reranker (the second stage of RAG): keeps the top_n nodes by
relevance to the query, best first, their score replaced by the reranker's relevance (0..1).

    from bge_triton.integrations.llama_index_rerank import BgeTritonRerank
    engine = index.as_query_engine(similarity_top_k=50,
                                   node_postprocessors=[BgeTritonRerank(url="127.0.0.1:8001", top_n=5)])
"""
from __future__ import annotations

from typing import Any

from bge_triton.extras import require

require("llamaindex", "bge_triton.integrations.llama_index_rerank")

from llama_index.core.postprocessor.types import BaseNodePostprocessor  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle  # noqa: E402
from pydantic import PrivateAttr  # noqa: E402

from bge_triton.integrations._clients import SdkClients  # noqa: E402

__all__ = ["BgeTritonRerank"]


class BgeTritonRerank(BaseNodePostprocessor):
    """The reranker's text-pair endpoint as a LlamaIndex node postprocessor; client_kwargs go to the SDK client."""

    url: str = "127.0.0.1:8001"
    model: str = "bge_reranker"
    top_n: int | None = 3
    _clients: SdkClients = PrivateAttr()

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "bge_reranker", top_n: int | None = 3,
                 client_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(url=url, model=model, top_n=top_n, **kwargs)  # type: ignore[call-arg]
        self._clients = SdkClients(url, "bge_large_zh", rerank_model=model, **(client_kwargs or {}))

    @classmethod
    def class_name(cls) -> str:
        return "BgeTritonRerank"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("BgeTritonRerank needs the query: call postprocess_nodes(nodes, query_str=...)")
        if not nodes:
            return []
        texts = [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
        ranked = self._clients.unchecked().rerank(query_bundle.query_str, texts, self.top_n)
        return [NodeWithScore(node=nodes[r.index].node, score=r.score) for r in ranked]

    def close(self) -> None:
        """Close the sync client's channel."""
        self._clients.close()

"""The LangChain and LlamaIndex adapters against the REAL local tritonserver: each framework's own
interface (embeddings, async twins, an in-memory vector store / index) returns the SDK's vectors."""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from bge_triton.client import EmbeddingClient

pytestmark = pytest.mark.integration

NAME = "minilm"
DOCS = ["The cat sits on the mat.", "Stock markets fell sharply on Monday.", "A recipe for tomato soup.",
        "Triton batches requests with its dynamic batcher."]
QUERY = "where is the cat sitting"


@pytest.fixture(scope="module")
def sdk(triton_server: Any):
    with EmbeddingClient(triton_server.grpc_url, model=NAME) as client:
        yield client


def test_langchain_embeddings_equal_sdk(triton_server, sdk) -> None:
    import langchain_core  # noqa: F401 - the extra this test needs
    from langchain_core.vectorstores import InMemoryVectorStore

    from bge_triton.integrations.langchain import BgeTritonEmbeddings

    emb = BgeTritonEmbeddings(triton_server.grpc_url, model=NAME)
    try:
        docs, query = sdk.embed_documents(DOCS), sdk.embed_queries([QUERY])[0]
        np.testing.assert_allclose(np.array(emb.embed_documents(DOCS)), docs, atol=1e-5)
        np.testing.assert_allclose(np.array(emb.embed_query(QUERY)), query, atol=1e-5)
        for _ in range(2):  # two event loops: each gets its own async client
            adocs = asyncio.run(emb.aembed_documents(DOCS))
            aquery = asyncio.run(emb.aembed_query(QUERY))
            np.testing.assert_allclose(np.array(adocs), docs, atol=1e-5)
            np.testing.assert_allclose(np.array(aquery), query, atol=1e-5)
        assert emb.embed_documents([]) == []
        store = InMemoryVectorStore.from_texts(DOCS, emb)
        assert store.similarity_search(QUERY, k=1)[0].page_content == DOCS[0]
    finally:
        emb.close()


def test_llama_index_embedding_equals_sdk(triton_server, sdk) -> None:
    import llama_index.core  # noqa: F401 - the extra this test needs
    from llama_index.core import Document, VectorStoreIndex

    from bge_triton.integrations.llama_index import BgeTritonEmbedding

    emb = BgeTritonEmbedding(triton_server.grpc_url, model=NAME, embed_batch_size=3)
    try:
        docs, query = sdk.embed_documents(DOCS), sdk.embed_queries([QUERY])[0]
        np.testing.assert_allclose(np.array(emb.get_text_embedding_batch(DOCS)), docs, atol=1e-5)
        np.testing.assert_allclose(np.array(emb.get_query_embedding(QUERY)), query, atol=1e-5)
        np.testing.assert_allclose(np.array(emb.get_text_embedding(DOCS[1])), docs[1], atol=1e-5)
        abatch = asyncio.run(emb.aget_text_embedding_batch(DOCS))
        np.testing.assert_allclose(np.array(abatch), docs, atol=1e-5)
        np.testing.assert_allclose(np.array(asyncio.run(emb.aget_query_embedding(QUERY))), query, atol=1e-5)
        index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS], embed_model=emb)
        hits = index.as_retriever(similarity_top_k=1).retrieve(QUERY)
        assert hits[0].node.get_content() == DOCS[0]
    finally:
        emb.close()

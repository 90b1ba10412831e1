"""One deployment for both RAG stages: the gateway as a real process (--model minilm --rerank-model ce) in front of
the REAL local tritonserver serving the MiniLM embedder and the MiniLM cross-encoder. TEI's /rerank and the
Cohere / Jina-shaped /v1/rerank rank as the SDK does, with auth, limits, timing headers and clear errors; the
embeddings route answers beside them; /ready needs both models."""
from __future__ import annotations

import math
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest_rerank import rerank_repo_fixture  # noqa: F401 - fixture
from test_gateway_openai import GatewayProc, free_port

from bge_triton.client import EmbeddingClient

pytestmark = pytest.mark.integration
KEY = "rerank-key-" + "y" * 24
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "Bananas are rich in potassium.",
        "Berlin is the capital of Germany.", "The Eiffel Tower is in Paris."]


@pytest.fixture(scope="module")
def rag(minilm_repo: Path, rerank_repo, server_factory, tmp_path_factory):
    """Triton with minilm (+ _onnx) and ce (+ _onnx); the gateway in front; the SDK's logits of DOCS."""
    repo = tmp_path_factory.mktemp("rag_repo")
    for src in (minilm_repo / "minilm", minilm_repo / "minilm_onnx", rerank_repo["repo"] / "ce",
                rerank_repo["repo"] / "ce_onnx"):
        os.symlink(src.resolve(), repo / src.name)
    srv = server_factory(repo)
    port = free_port()
    gw = GatewayProc(["--triton", srv.grpc_url, "--model", "minilm", "--rerank-model", "ce", "--api-key", KEY],
                     port, tmp_path_factory.mktemp("gw") / "gateway.log").wait()
    client = EmbeddingClient(srv.grpc_url, rerank_model="ce")
    logits = {r.index: r.logit for r in client.rerank(QUERY, DOCS)}
    client.close()
    yield gw, logits
    gw.stop()


def post(gw, path, body, key=KEY, **headers):
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + path, json=body, headers={**auth, **headers}, timeout=60)


def test_tei_rerank_sorted_sigmoid_scores_text_and_raw(rag) -> None:
    gw, logits = rag
    r = post(gw, "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = sorted(logits, key=lambda i: -logits[i])
    assert [x["index"] for x in body] == want
    assert all(abs(x["score"] - 1 / (1 + math.exp(-logits[x["index"]]))) < 1e-5 for x in body)
    assert [x["text"] for x in body] == [DOCS[i] for i in want]
    assert all(h in r.headers for h in ("x-tokenization-time", "x-queue-time", "x-inference-time", "x-total-time"))
    raw = post(gw, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    assert all(abs(x["score"] - logits[x["index"]]) < 1e-5 and "text" not in x for x in raw)


def test_cohere_rerank_top_n_documents_and_usage(rag) -> None:
    gw, logits = rag
    r = post(gw, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]],
                                "top_n": 2, "return_documents": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = sorted(logits, key=lambda i: -logits[i])[:2]
    assert [x["index"] for x in body["results"]] == want and body["model"] == "ce"
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in want]
    assert all(0 < x["relevance_score"] < 1 for x in body["results"])
    assert body["usage"]["total_tokens"] > sum(len(d.split()) for d in DOCS)  # every pair, special tokens in


def test_one_deployment_serves_both_stages_and_ready_needs_both(rag) -> None:
    gw, _ = rag
    emb = post(gw, "/v1/embeddings", {"model": "minilm", "input": [QUERY, *DOCS]})
    assert emb.status_code == 200 and len(emb.json()["data"]) == 5
    vectors = np.array([d["embedding"] for d in emb.json()["data"]])
    top = int(np.argmax(vectors[1:] @ vectors[0]))  # first stage: retrieve; second: rerank the candidates
    rer = post(gw, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS})
    assert rer.status_code == 200 and 0 <= top < len(DOCS)
    assert httpx.get(gw.url + "/ready").json()["status"] == "ready"
    spec = httpx.get(gw.url + "/openapi.json").json()
    assert {"/rerank", "/v1/rerank"} <= set(spec["paths"])


@pytest.mark.parametrize("path, body, status, words", [
    ("/rerank", {"query": " ", "texts": DOCS}, 422, "`query` is empty"),
    ("/v1/rerank", {"model": "ce", "query": QUERY, "documents": []}, 400, "`documents` is empty"),
    ("/rerank", {"query": QUERY, "texts": [DOCS[0], " ".join(["word"] * 400)]}, 413, "document 1: the pair has"),
    ("/v1/rerank", {"model": "nope", "query": QUERY, "documents": DOCS}, 404, "'nope' does not exist"),
    ("/rerank", {"query": QUERY, "texts": ["x"] * 3000}, 413, "the limit is 2048"),
    ("/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 0}, 400, "top_n"),
])
def test_bad_input_answers_clearly(rag, path, body, status, words) -> None:
    gw, _ = rag
    r = post(gw, path, body)
    assert r.status_code == status, r.text
    assert words in r.text
    assert post(gw, "/rerank", {"query": QUERY, "texts": DOCS[:2]}).status_code == 200  # nothing else disturbed


def test_rerank_needs_the_key(rag) -> None:
    gw, _ = rag
    assert post(gw, "/rerank", {"query": QUERY, "texts": DOCS}, key=None).status_code == 401
    assert post(gw, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS}, key="wrong").status_code == 401


def test_a_2000_document_body_does_not_stall_small_reranks(rag) -> None:
    """Parsed off the loop (a body over 64 KiB) and sent at the bulk level: small reranks beside it are answered
    first."""
    import concurrent.futures as cf
    import threading
    import time

    gw, _ = rag
    big_docs = [f"{DOCS[i % len(DOCS)]} Note {i}." for i in range(2000)]
    finished: list[str] = []
    lock = threading.Lock()

    def call(name, body):
        r = post(gw, "/rerank", body)
        with lock:
            finished.append(name)
        return r

    with cf.ThreadPoolExecutor(5) as pool:
        big = pool.submit(call, "big", {"query": QUERY, "texts": big_docs, "truncate": True})
        time.sleep(0.5)  # the big body is in first (ordering, not a timing assertion)
        small = [pool.submit(call, f"small{i}", {"query": QUERY, "texts": DOCS[:3]}) for i in range(4)]
        assert all(f.result(timeout=120).status_code == 200 for f in small)
        r = big.result(timeout=300)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()) == 2000 and finished[-1] == "big", finished

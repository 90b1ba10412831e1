"""The reranker on a real local tritonserver: served scores equal transformers' and sentence-transformers'
CrossEncoder on the same weights (real MiniLM trunk + seeded head; the synthetic exact layout), the order agrees,
bad input gets clear errors while the rest is served, and a 2,000-document request does not hold small queries."""
from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest_rerank import MAX_LENGTH, rerank_repo_fixture, rerank_server_fixture  # noqa: F401 - fixtures
from tritonclient.utils import InferenceServerException

from bge_triton.client import AsyncEmbeddingClient, EmbeddingClient, InputError, RetryPolicy
from bge_triton.client.errors import KitError


class Reranker:
    """An EmbeddingClient used for rerank() alone: this server serves rerankers only, so no `with` (entering
    checks the embedder's config); closed at exit."""

    def __init__(self, url, name, **kw):
        self.client = EmbeddingClient(url, rerank_model=name, **kw)

    def __enter__(self):
        return self.client

    def __exit__(self, *exc):
        self.client.close()

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "The Eiffel Tower is in Paris.",
        "Bananas are rich in potassium.", "Berlin is the capital of Germany.", "France is a country in Europe.",
        "今天天气很好，我们去公园散步吧。", "The quick brown fox jumps over the lazy dog."]
ZH_QUERY = "这家酒店怎么样？"
ZH_DOCS = ["酒店的服务非常周到，房间也很干净。", "物流太慢了，等了一个星期才到。", "早餐种类很多，味道不错。",
           "手机电池不耐用。", "酒店离地铁站很近，交通方便。"]


def transformers_logits(model_dir, query, docs, truncation="only_second"):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    out = []
    for d in docs:  # each pair alone: no padding in the reference
        enc = tok(query, d, truncation=truncation, max_length=MAX_LENGTH, return_tensors="pt")
        with torch.inference_mode():
            out.append(float(model(**enc).logits[0, 0]))
    return np.array(out)


@pytest.mark.parametrize("name, query, docs", [("ce", QUERY, DOCS), ("rr", ZH_QUERY, ZH_DOCS + DOCS[:2])])
def test_served_scores_equal_transformers_and_the_order_agrees(rerank_repo, rerank_server, name, query, docs) -> None:
    want = transformers_logits(rerank_repo[name], query, docs)
    with Reranker(rerank_server.grpc_url, name) as client:
        got = client.rerank(query, docs)
    logits = np.empty(len(docs))
    for r in got:
        logits[r.index] = r.logit
    assert np.abs(logits - want).max() <= 1e-4 * max(1.0, np.ptp(want)), (logits, want)
    assert [r.index for r in got] == list(np.argsort(-want, kind="stable"))
    assert [r.score for r in got] == sorted((r.score for r in got), reverse=True)


def test_the_minilm_cross_encoder_matches_sentence_transformers_crossencoder(rerank_repo, rerank_server) -> None:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(rerank_repo["ce"]), max_length=MAX_LENGTH, device="cpu")
    want = ce.predict([(QUERY, d) for d in DOCS])  # one label: sigmoid of the logit
    with Reranker(rerank_server.grpc_url, "ce") as client:
        got = client.rerank(QUERY, DOCS, top_n=3)
    assert len(got) == 3
    assert [r.index for r in got] == list(np.argsort(-want, kind="stable")[:3])
    assert np.allclose([r.score for r in got], np.sort(want)[::-1][:3], atol=1e-5)
    # ranked by the real MiniLM trunk: a head of random weights still scores the two Paris passages alike
    assert np.ptp(want) > 0.05


def test_an_over_long_document_is_cut_and_the_query_kept(rerank_repo, rerank_server) -> None:
    long_doc = " ".join(["Paris is lovely in the spring and the food is good."] * 40)
    for direction in ("right", "left"):
        want = transformers_logits(rerank_repo["ce"], QUERY, [long_doc, DOCS[0]])
        if direction == "left":
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(rerank_repo["ce"]), truncation_side="left")
            assert tok(QUERY, long_doc, truncation="only_second", max_length=MAX_LENGTH)["input_ids"][1] == \
                tok(QUERY)["input_ids"][1]  # the query stays whole on either side
        with Reranker(rerank_server.grpc_url, "ce") as client:
            got = {r.index: r.logit for r in client.rerank(QUERY, [long_doc, DOCS[0]],
                                                           truncation_direction=direction)}
        if direction == "right":
            assert abs(got[0] - want[0]) < 1e-4 and abs(got[1] - want[1]) < 1e-4


def _raw(url, query, docs, timeout_s: float = 0, **params):
    """One request straight to the endpoint (tritonclient); timeout_s: Triton's per-request queue timeout."""
    client = grpcclient.InferenceServerClient(url)
    q = np.array([[query.encode()]], dtype=object)
    d = np.array([[x.encode() for x in docs]], dtype=object).reshape(1, len(docs))
    inputs = [grpcclient.InferInput("query", [1, 1], "BYTES"), grpcclient.InferInput("documents", list(d.shape),
                                                                                      "BYTES")]
    inputs[0].set_data_from_numpy(q)
    inputs[1].set_data_from_numpy(d)
    return client.infer("ce", inputs, parameters=params or None,
                        timeout=int(timeout_s * 1e6) or None).as_numpy("score")


@pytest.mark.parametrize("query, docs, params, words", [
    ("  ", DOCS[:2], {}, "the query is empty"),
    (QUERY, [], {}, "no documents"),
    (QUERY, [DOCS[0], " ".join(["word"] * 400)], {"truncate": False}, "document 1: the pair has"),
])
def test_bad_input_is_a_clear_error_and_the_server_serves_on(rerank_server, query, docs, params, words) -> None:
    with pytest.raises(InferenceServerException) as err:
        _raw(rerank_server.grpc_url, query, docs, **params)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and words in err.value.message()
    assert _raw(rerank_server.grpc_url, QUERY, DOCS).shape == (1, len(DOCS))


def test_sdk_refuses_what_it_can_check_before_sending(rerank_server) -> None:
    with Reranker(rerank_server.grpc_url, "ce", retry=RetryPolicy.off()) as client:
        with pytest.raises(InputError, match="no documents"):
            client.rerank(QUERY, [])
        with pytest.raises(InputError, match="top_n"):
            client.rerank(QUERY, DOCS, top_n=0)
        with pytest.raises(KitError, match="query is empty"):
            client.rerank(" ", DOCS)


def test_a_thousand_documents_in_one_request_come_back_in_order(rerank_server) -> None:
    docs = [f"{DOCS[i % len(DOCS)]} ({i})" for i in range(1000)]
    scores = _raw(rerank_server.grpc_url, QUERY, docs, timeout_s=300)  # 2 shared CPU cores: past the 5 s default
    again = _raw(rerank_server.grpc_url, QUERY, docs[:7])  # batching does not change a score
    assert scores.shape == (1, 1000) and np.allclose(scores[0, :7], again[0], atol=1e-4)


def test_a_2000_document_body_does_not_stall_small_queries(rerank_server) -> None:
    """A bulk request (priority 2) of 2,000 documents is in flight; small queries at priority 1 go past it."""
    docs = [" ".join([DOCS[i % len(DOCS)]] * 6) for i in range(2000)]
    finished: list[str] = []
    lock = threading.Lock()

    def big():
        out = _raw(rerank_server.grpc_url, QUERY, docs, timeout_s=600, priority_level=2)
        with lock:
            finished.append("big")
        return out

    def small(i):
        with Reranker(rerank_server.grpc_url, "ce", timeout_s=60) as client:
            got = client.rerank(QUERY, DOCS[:3], priority=1)
        with lock:
            finished.append(f"small{i}")
        return got

    with cf.ThreadPoolExecutor(6) as pool:
        bulk = pool.submit(big)
        import time

        time.sleep(0.3)  # the bulk request is queued first (ordering, not a timing assertion)
        smalls = [pool.submit(small, i) for i in range(4)]
        results = [f.result(timeout=120) for f in smalls]
        assert bulk.result(timeout=300).shape == (1, 2000)
    assert all(len(r) == 3 for r in results)
    assert finished.index("big") == len(finished) - 1, finished  # every small query was answered before it


def test_async_client_reranks_the_same(rerank_server) -> None:
    import asyncio

    async def go():
        client = AsyncEmbeddingClient(rerank_server.grpc_url, rerank_model="ce")
        try:
            return await client.rerank(QUERY, DOCS, top_n=2)
        finally:
            await client.aclose()

    with Reranker(rerank_server.grpc_url, "ce") as client:
        sync = client.rerank(QUERY, DOCS, top_n=2)
    got = asyncio.run(go())
    assert [r.index for r in got] == [r.index for r in sync] and np.allclose([r.score for r in got],
                                                                             [r.score for r in sync], atol=1e-6)


def test_langchain_compressor_and_llamaindex_postprocessor_rank_as_the_sdk(rerank_server) -> None:
    import asyncio

    from langchain_core.documents import Document
    from llama_index.core.schema import NodeWithScore, TextNode

    from bge_triton.integrations.langchain_rerank import BgeTritonRerank as LcRerank
    from bge_triton.integrations.llama_index_rerank import BgeTritonRerank as LiRerank

    with Reranker(rerank_server.grpc_url, "ce") as client:
        want = client.rerank(QUERY, DOCS, top_n=3)
    lc = LcRerank(url=rerank_server.grpc_url, model="ce", top_n=3)
    docs = [Document(page_content=d, metadata={"i": i}) for i, d in enumerate(DOCS)]
    got = lc.compress_documents(docs, QUERY)
    assert [d.metadata["i"] for d in got] == [r.index for r in want]
    assert np.allclose([d.metadata["relevance_score"] for d in got], [r.score for r in want], atol=1e-6)
    again = asyncio.run(lc.acompress_documents(docs, QUERY))
    assert [d.metadata["i"] for d in again] == [r.index for r in want]
    lc.close()
    li = LiRerank(url=rerank_server.grpc_url, model="ce", top_n=3)
    nodes = [NodeWithScore(node=TextNode(text=d, id_=str(i)), score=0.0) for i, d in enumerate(DOCS)]
    ranked = li.postprocess_nodes(nodes, query_str=QUERY)
    assert [n.node.id_ for n in ranked] == [str(r.index) for r in want]
    assert np.allclose([n.score for n in ranked], [r.score for r in want], atol=1e-6)
    li.close()


def test_verify_holds_the_served_reranker_to_its_export_reference(rerank_repo, rerank_server, tmp_path) -> None:
    import json

    from bge_triton.verify.__main__ import main as verify

    url = f"http://{rerank_server.http_url}"  # HOST:PORT alone is gRPC; a reranker is checked over HTTP
    for name in ("ce", "rr"):
        assert verify(["--url", url, "--model", name, "--repository", str(rerank_repo["repo"])]) == 0
    ref = json.loads((rerank_repo["repo"] / "ce_onnx" / "1" / "reference.json").read_text())
    for p in ref["pairs"]:
        p["score"] += 0.5  # another model's numbers
    bad = tmp_path / "reference.json"
    bad.write_text(json.dumps(ref))
    assert verify(["--url", url, "--model", "ce", "--reference", str(bad)]) == 1

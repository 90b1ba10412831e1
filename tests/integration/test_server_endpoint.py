"""Issue 3 on the real local tritonserver: the CPU variant loads, the text endpoint matches ONNX
Runtime, concurrent requests of different lengths are batched without changing results, a bad
request fails alone inside one Triton batch, and a full queue answers UNAVAILABLE / 503."""
from __future__ import annotations

import concurrent.futures as cf
import fcntl
import os
import threading
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from bge_triton.repository import Batching, load_config, write_config
from bge_triton.server.cpu_variant import CpuVariant

TEXTS = [
    "今天天气很好，我们去公园散步吧。",
    "这家餐厅的服务态度非常差，菜也不好吃，再也不来了。",
    "Retrieval augmented generation needs fast embeddings.",
    "hello",
    "向量检索是RAG系统的第一步，延迟和吞吐都很重要。" * 6,
    "A much longer English paragraph about dynamic batching on Triton Inference Server. " * 8,
]


def embed_text(url: str, model: str, texts: list[str], **params) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    arr = np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(-1, 1)
    inp = grpcclient.InferInput("text", list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr)
    return client.infer(model, [inp], parameters=params or None).as_numpy("embedding")


@pytest.fixture(scope="module")
def reference(minilm_repo: Path):
    """ONNX Runtime on the same model.onnx with the same tokenizer, one text at a time."""
    tok = Tokenizer.from_file(str(minilm_repo / "minilm" / "1" / "tokenizer" / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    sess = ort.InferenceSession(str(minilm_repo / "minilm_onnx" / "1" / "model.onnx"),
                                providers=["CPUExecutionProvider"])

    def ref(texts: list[str]) -> np.ndarray:
        rows = []
        for text in texts:
            ids = np.array([tok.encode(text).ids], dtype=np.int64)
            rows.append(sess.run(["embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0])
        return np.stack(rows)

    return ref


def kit_counters(metrics_url: str, model: str) -> dict[str, float]:
    """The text endpoint's own counters, once they settle (Triton's batch_stats stay empty: it answers through
    senders). The stub sends them when its scheduler goes idle, just after the last answer: read until two
    reads 0.3 s apart (more than metrics_flush_s) agree."""
    def read() -> dict[str, float]:
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                    if line.startswith("kit_") and f'model="{model}"' in line}

    last = read()
    for _ in range(20):
        threading.Event().wait(0.3)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError(f"the kit's counters of {model} never settled: {last}")


def kit_counter(metrics_url: str, name: str, model: str) -> float:
    return kit_counters(metrics_url, model).get(name, 0.0)


def test_cpu_variant_loads_and_is_ready(triton_server) -> None:
    client = httpclient.InferenceServerClient(triton_server.http_url)
    assert client.is_server_ready()
    for model in ("minilm", "minilm_onnx"):
        assert client.is_model_ready(model)
        cfg = client.get_model_config(model)
        assert cfg["output"][0]["dims"] == ["384"] or cfg["output"][0]["dims"] == [384]
    assert client.get_model_config("minilm_onnx")["backend"] == "python"  # the CPU variant


def test_onnx_runtime_runs_take_turns_through_the_cpu_lock(triton_server, minilm_repo: Path, reference) -> None:
    """Two instances of each model; every ONNX Runtime run (text endpoint and encoder) holds the lock."""
    http = httpclient.InferenceServerClient(triton_server.http_url)
    for model in ("minilm", "minilm_onnx"):
        cfg = http.get_model_config(model)
        assert cfg["instance_group"][0]["count"] == 2, cfg["instance_group"]
        assert cfg["parameters"]["cpu_lock"]["string_value"] == "1"
    lock_path = triton_server.state / "repository" / ".cpu_compute.lock"
    assert lock_path.is_file()  # opened by the instances at load
    tok = Tokenizer.from_file(str(minilm_repo / "minilm" / "1" / "tokenizer" / "tokenizer.json"))
    tok.no_padding()
    ids = np.array([tok.encode(TEXTS[0]).ids], dtype=np.int64)

    def tensor() -> np.ndarray:
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        inputs = [grpcclient.InferInput(n, list(ids.shape), "INT64") for n in ("input_ids", "attention_mask")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(np.ones_like(ids))
        return client.infer("minilm_onnx", inputs).as_numpy("embedding")

    with open(lock_path, "a+") as held, cf.ThreadPoolExecutor(2) as pool:
        fcntl.flock(held, fcntl.LOCK_EX)  # this test holds the cores
        try:
            calls = [pool.submit(embed_text, triton_server.grpc_url, "minilm", [TEXTS[0]]), pool.submit(tensor)]
            done, _ = cf.wait(calls, timeout=1.5)
            assert not done, "an ONNX Runtime run went ahead without the CPU lock"
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        want = reference([TEXTS[0]])[0]
        for call in calls:
            assert float(call.result(timeout=60)[0] @ want) >= 0.999


def test_text_endpoint_matches_onnxruntime_singles_and_batch(triton_server, reference) -> None:
    want = reference(TEXTS)
    batch = embed_text(triton_server.grpc_url, "minilm", TEXTS)
    singles = np.stack([embed_text(triton_server.grpc_url, "minilm", [t])[0] for t in TEXTS])
    for got in (batch, singles):
        assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
        cos = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.999, cos
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(batch, singles, atol=2e-5)  # batch of N == N singles


def test_concurrent_different_lengths_are_batched_unchanged(triton_server, reference) -> None:
    want = reference(TEXTS)
    url = triton_server.metrics_url
    names = ("kit_texts_total", "kit_sub_batches_total")
    before = [kit_counters(url, "minilm").get(name, 0.0) for name in names]
    jobs = [i % len(TEXTS) for i in range(96)]
    with cf.ThreadPoolExecutor(24) as pool:
        outs = list(pool.map(lambda i: embed_text(triton_server.grpc_url, "minilm", [TEXTS[i]])[0], jobs))
    for i, out in zip(jobs, outs, strict=True):
        assert float(out @ want[i]) >= 0.999
    after = kit_counters(url, "minilm")
    texts, subs = (after.get(name, 0.0) - b for name, b in zip(names, before, strict=True))
    assert texts == 96 and subs < texts, (texts, subs)  # texts of different requests shared encoder calls


def test_truncate_false_reports_token_count(triton_server) -> None:
    with pytest.raises(InferenceServerException, match=r"text 0 has \d+ tokens, over the limit of 256"):
        embed_text(triton_server.grpc_url, "minilm", ["word " * 400], truncate=False)
    out = embed_text(triton_server.grpc_url, "minilm", ["word " * 400])  # default: truncates
    assert out.shape == (1, 384)


def _clone_pair(repo: Path, src: str, dst: str, out: Path) -> Path:
    """A repository with the exported pair plus a copy under another name (files symlinked)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (src, f"{src}_onnx"):
        for new in (name, name.replace(src, dst)):
            target = out / new
            if target.exists():
                continue
            (target / "1").mkdir(parents=True)
            for item in (repo / name / "1").iterdir():
                os.symlink(item.resolve(), target / "1" / item.name)
            cfg = load_config(repo / name)
            cfg.name = new
            if "onnx_model" in cfg.parameters:
                cfg.parameters["onnx_model"].string_value = f"{new}_onnx"
            write_config(cfg, target / "config.pbtxt", "tests/integration/test_server_endpoint.py")
    return out


@pytest.fixture(scope="module")
def held_server(minilm_repo: Path, server_factory, tmp_path_factory):
    """minilm waits for 7 rows (one Triton batch); minilmq_onnx queue holds only 2."""
    repo = _clone_pair(minilm_repo, "minilm", "minilmq", tmp_path_factory.mktemp("held_repo"))
    variant = CpuVariant(batching={
        "minilm": Batching(preferred_batch_sizes=(7,), max_queue_delay_us=3_000_000),
        "minilmq_onnx": Batching(preferred_batch_sizes=(64,), max_queue_delay_us=1_000_000, max_queue_size=2,
                                queue_timeout_us=10_000_000),
    })
    return server_factory(repo, variant=variant)


def test_bad_requests_fail_alone_inside_one_batch(held_server, reference) -> None:
    payloads = [["今天天气很好"], ["   "], ["hello world"], [b"\xff\xfeabc"], ["ok"], ["x" * 10, ""]]
    before = kit_counter(held_server.metrics_url, "kit_text_batches_total", "minilm")

    def send(texts):
        client = grpcclient.InferenceServerClient(held_server.grpc_url)
        arr = np.array([t if isinstance(t, bytes) else t.encode() for t in texts], dtype=object).reshape(-1, 1)
        inp = grpcclient.InferInput("text", list(arr.shape), "BYTES")
        inp.set_data_from_numpy(arr)
        try:
            return client.infer("minilm", [inp]).as_numpy("embedding")
        except InferenceServerException as exc:
            return exc

    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(send, payloads))
    after = kit_counter(held_server.metrics_url, "kit_text_batches_total", "minilm")
    assert after - before == 1, (before, after)  # 6 requests, 7 rows: ONE Triton batch (the endpoint's counter)
    assert "empty or whitespace" in str(results[1])
    assert "not valid UTF-8" in str(results[3])
    assert "text 1 is empty" in str(results[5])
    for i, texts in ((0, ["今天天气很好"]), (2, ["hello world"]), (4, ["ok"])):
        assert isinstance(results[i], np.ndarray), results[i]
        assert float(results[i][0] @ reference(texts)[0]) >= 0.999
    assert httpclient.InferenceServerClient(held_server.http_url).is_server_ready()


def test_full_queue_answers_unavailable_and_503(held_server) -> None:
    ids = np.array([[101, 7592, 102]], dtype=np.int64)

    def send(_):
        client = httpclient.InferenceServerClient(held_server.http_url)
        inputs = []
        for name in ("input_ids", "attention_mask"):
            inp = httpclient.InferInput(name, list(ids.shape), "INT64")
            inp.set_data_from_numpy(ids if name == "input_ids" else np.ones_like(ids))
            inputs.append(inp)
        try:
            return client.infer("minilmq_onnx", inputs).as_numpy("embedding")
        except InferenceServerException as exc:
            return exc

    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(send, range(6)))
    rejected = [r for r in results if isinstance(r, InferenceServerException)]
    served = [r for r in results if isinstance(r, np.ndarray)]
    assert len(served) == 2 and len(rejected) == 4, [str(r) for r in results]
    for exc in rejected:
        assert "Exceeds maximum queue size" in exc.message()
        assert exc.status() in ("503", "StatusCode.UNAVAILABLE", 503)
    grpc = grpcclient.InferenceServerClient(held_server.grpc_url)
    inputs = [grpcclient.InferInput(n, list(ids.shape), "INT64") for n in ("input_ids", "attention_mask")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.ones_like(ids))
    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(grpc.infer, "minilmq_onnx", inputs) for _ in range(6)]
        errors = [f.exception() for f in futures if f.exception() is not None]
    assert errors and all(e.status() == "StatusCode.UNAVAILABLE" for e in errors), errors


def test_custom_metrics_exported(triton_server) -> None:
    embed_text(triton_server.grpc_url, "minilm", TEXTS)
    values = kit_counters(triton_server.metrics_url, "minilm")
    assert values["kit_real_tokens_total"] > 0
    assert values["kit_padded_tokens_total"] >= values["kit_real_tokens_total"]
    assert values["kit_texts_total"] >= values["kit_sub_batches_total"] >= 1  # sub-batches pool texts across batches
    assert values["kit_text_batches_total"] >= 1
    assert values["kit_queue_requests_total"] >= 1 and "kit_queue_duration_us_total" in values  # the pool wait


def test_priority_reaches_the_text_endpoint_and_a_bad_level_is_named(triton_server) -> None:
    import asyncio

    from bge_triton.client import AsyncEmbeddingClient

    async def both() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncEmbeddingClient(triton_server.grpc_url, model="minilm") as c:
            return (await c.embed_documents(TEXTS[:2], priority=1), await c.embed_documents(TEXTS[:2]))

    high, default = asyncio.run(both())  # Triton's priority and priority_level together: accepted
    np.testing.assert_allclose(high, default, atol=1e-5)
    with pytest.raises(InferenceServerException, match="parameter priority_level='1'") as err:
        embed_text(triton_server.grpc_url, "minilm", TEXTS[:1], priority_level="1")
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"

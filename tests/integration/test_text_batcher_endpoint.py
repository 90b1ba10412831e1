"""The text endpoint in scheduler "triton" (text_batcher.py) on a REAL tritonserver 2.51: Triton's batcher holds the
waiting requests, execute plans its batch and runs it through BLS async_exec (issue 24's alternative).

Two servers, each rendered by server.cpu_variant from the exported MiniLM pair with this checkout's text endpoint:
- `embed`: the real ONNX Runtime encoder (minilm_onnx) behind two text endpoints that differ only in their
  scheduler, `pool_m` (the committed "pool") and `trit_m` ("triton", server.repository.triton_mode_config): the same
  texts give the same embeddings and token counts; bad input is INVALID_ARG naming the field.
- `slow`: an emulated encoder (cost model, 0.2 s a call, one instance, no queue delay) that answers one column short
  for a sub-batch holding "poison", behind `tb` in scheduler "triton" with ONE instance, one text per sub-batch, one
  at a time: a request of N texts holds the instance for N calls, so the next request waits in Triton's queue, and
  the encoder's statistics count texts; beside it the query-only model `tb_query` (query_model_config).
Waits are bounded by progress; timeouts are only a safety net.
"""
from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.repository import (
    TEXT_ENDPOINT_FILES,
    TEXT_MODEL_DIR,
    Batching,
    TritonMode,
    load_config,
    query_model_config,
    set_param,
    set_text_settings,
    triton_mode_config,
    write_config,
)

pytestmark = pytest.mark.integration

CALL_S = 0.2  # emulated encoder time per call
CODE = TEXT_ENDPOINT_FILES  # this checkout's text endpoint (text_batcher.py included)
HERE = "tests/integration/test_text_batcher_endpoint.py"


def _text_endpoint(src: Path, out: Path, name: str, encoder: str, mode: TritonMode | None, **settings) -> None:
    """The export's text endpoint config as `name` (scheduler "triton" when `mode` is given), with this checkout's
    code and the export's tokenizer."""
    cfg = load_config(src / "minilm")
    cfg.name = name
    set_text_settings(cfg, onnx_model=encoder, **settings)
    if mode is not None:
        cfg = triton_mode_config(cfg, mode)
    version = out / name / "1"
    version.mkdir(parents=True)
    os.symlink((src / "minilm" / "1" / "tokenizer").resolve(), version / "tokenizer")
    for file in CODE:
        os.symlink(TEXT_MODEL_DIR / file, version / file)
    write_config(cfg, out / name / "config.pbtxt", HERE)


def _encoder(src: Path, out: Path, name: str, **params) -> None:
    cfg = load_config(src / "minilm_onnx")
    cfg.name = name
    for key, value in params.items():
        set_param(cfg, key, value)
    version = out / name / "1"
    version.mkdir(parents=True)
    for item in (src / "minilm_onnx" / "1").iterdir():
        os.symlink(item.resolve(), version / item.name)
    write_config(cfg, out / name / "config.pbtxt", HERE)


@pytest.fixture(scope="module")
def embed(minilm_repo: Path, server_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("batcher_embed_repo")
    _encoder(minilm_repo, out, "minilm_onnx")
    _text_endpoint(minilm_repo, out, "pool_m", "minilm_onnx", None)
    _text_endpoint(minilm_repo, out, "trit_m", "minilm_onnx", TritonMode(max_batch_size=128, instances=2))
    # text_params {}: both keep their own settings (encoder "bls": the triton mode's BLS async_exec runs for real)
    return server_factory(out, variant=CpuVariant(executor="onnxruntime", text_params={}, text_instances=2))


@pytest.fixture(scope="module")
def slow(minilm_repo: Path, server_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("batcher_slow_repo")
    tok = Tokenizer.from_file(str(minilm_repo / "minilm" / "1" / "tokenizer" / "tokenizer.json"))
    _encoder(minilm_repo, out, "tb_onnx", fault_token_id=tok.token_to_id("poison"), fault="shape")
    _text_endpoint(minilm_repo, out, "tb", "tb_onnx", TritonMode(max_batch_size=64, instances=1, max_in_flight=1),
                   sub_batch_max=1, cancel_check_s=0.02)
    query = query_model_config(load_config(out / "tb"), TritonMode(max_batch_size=8, instances=1, max_in_flight=1))
    (out / query.name / "1").mkdir(parents=True)
    for item in (out / "tb" / "1").iterdir():
        os.symlink(item.resolve(), out / query.name / "1" / item.name)
    write_config(query, out / query.name / "config.pbtxt", HERE)
    variant = CpuVariant(executor="costmodel", cost_a_us=CALL_S * 1e6, cost_b_us=0.0, encoder_instances=1,
                         text_params={}, text_instances=1,
                         batching={"tb_onnx": Batching(max_queue_delay_us=0, preferred_batch_sizes=())})
    return server_factory(out, variant=variant)


def _inputs(texts):
    inp = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return [inp]


def _outputs(*names):
    return [grpcclient.InferRequestedOutput(n) for n in names]


def _encoded(client, model: str = "tb_onnx") -> int:
    """Texts the encoder ran (its own statistics)."""
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"]
    return sum(int(s.get("inference_count", 0)) for s in stats)


def _pending(metrics_url: str, model: str) -> float:
    """Triton's nv_inference_pending_request_count of a model (requests in its queue, not yet executing)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("nv_inference_pending_request_count") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _until(check, timeout_s: float = 60.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.02)


TEXTS = ["今天天气很好", "Retrieval augmented generation needs fast embeddings.", "hello", "a " * 200,
         "The quick brown fox jumps over the lazy dog, again and again."]


def test_the_triton_mode_embeds_as_the_pool_mode(embed) -> None:
    client = grpcclient.InferenceServerClient(embed.grpc_url)
    config = client.get_model_config("trit_m", as_json=True)["config"]
    assert config["parameters"]["scheduler"]["string_value"] == "triton" and config["max_batch_size"] == 128
    assert client.get_model_config("pool_m", as_json=True)["config"]["parameters"]["scheduler"]["string_value"] == \
        "pool"
    got = {}
    for model in ("pool_m", "trit_m"):
        result = client.infer(model, _inputs(TEXTS), outputs=_outputs("embedding", "token_count"))
        got[model] = result.as_numpy("embedding"), result.as_numpy("token_count")
    np.testing.assert_allclose(got["trit_m"][0], got["pool_m"][0], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got["trit_m"][1], got["pool_m"][1])
    assert got["trit_m"][0].shape == (len(TEXTS), 384) and got["trit_m"][1][3, 0] > got["trit_m"][1][2, 0] == 3
    singles = np.concatenate([client.infer("trit_m", _inputs([t])).as_numpy("embedding") for t in TEXTS])
    np.testing.assert_allclose(singles, got["trit_m"][0], rtol=0, atol=1e-5)  # batching changes nothing


@pytest.mark.parametrize("texts, parameters, field", [
    ([" "], {}, "text 0 is empty"),
    (["hello"], {"truncation_direction": "up"}, "parameter truncation_direction='up'"),
    (["hello"], {"priority_level": "high"}, "parameter priority_level='high'"),
])
def test_bad_input_is_invalid_arg_naming_the_field(embed, texts, parameters, field) -> None:
    client = grpcclient.InferenceServerClient(embed.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        client.infer("trit_m", _inputs(texts), parameters=parameters)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value.message()
    assert field in info.value.message()
    assert client.infer("trit_m", _inputs(["hello"])).as_numpy("embedding").shape == (1, 384)  # serves on


def test_an_encoder_answer_of_the_wrong_shape_fails_its_request_and_the_endpoint_serves_on(slow) -> None:
    client = grpcclient.InferenceServerClient(slow.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        client.infer("tb", _inputs(["hello", "a poison apple"]))
    assert info.value.status() == "StatusCode.INTERNAL", info.value.message()
    assert "answered shape [1, 383]" in info.value.message() and "expected [1, 384]" in info.value.message()
    out = client.infer("tb", _inputs(["hello", "world"])).as_numpy("embedding")
    assert out.shape == (2, 384) and np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-3)


def test_a_request_timeout_shorter_than_the_default_is_honoured_by_tritons_queue(slow) -> None:
    client = grpcclient.InferenceServerClient(slow.grpc_url)
    answers: queue.Queue = queue.Queue()
    before = _encoded(client)
    client.async_infer("tb", _inputs([f"busy {i}" for i in range(4)]),
                       callback=lambda result, error: answers.put((result, error)))
    _until(lambda: _encoded(client) > before, what="the busy request's first text")  # the one instance is busy
    with pytest.raises(InferenceServerException) as info:
        client.infer("tb", _inputs(["in a hurry"]), timeout=100_000)  # its own 0.1 s; the config's default is 5 s
    assert info.value.status() == "StatusCode.UNAVAILABLE", info.value.message()
    assert "Request timeout expired" in info.value.message()  # Triton's own queue, not the text endpoint
    result, error = answers.get(timeout=60)
    assert error is None and result.as_numpy("embedding").shape == (4, 384)


def test_a_cancelled_request_sends_none_of_its_texts_still_to_go(slow) -> None:
    client = grpcclient.InferenceServerClient(slow.grpc_url)
    before = _encoded(client)
    answers: queue.Queue = queue.Queue()
    n = 12  # twelve encoder calls of 0.2 s if nothing is dropped
    call = client.async_infer("tb", _inputs([f"cancel me {i}" for i in range(n)]),
                              callback=lambda result, error: answers.put((result, error)))
    _until(lambda: _encoded(client) > before, what="the request's first text at the encoder")
    call.cancel()
    result, error = answers.get(timeout=60)
    assert result is None and "CANCELLED" in str(error.status()).upper(), (error.status(), error.message())
    # the next request runs once the instance is free, i.e. after the cancelled batch ended: then the count is final
    marker = client.infer("tb", _inputs(["marker"])).as_numpy("embedding")
    assert marker.shape == (1, 384)
    ran = _encoded(client) - before - 1
    assert 1 <= ran <= n // 2, f"{ran} of the cancelled request's {n} texts reached the encoder"


def test_a_query_to_the_query_model_does_not_wait_for_the_bulk_models_instance(slow) -> None:
    """The bulk model's one instance holds a request of 12 texts (12 encoder calls one after the other); a query sent
    to tb_query meanwhile is answered while that bulk request is still running (it waits at the encoder behind one
    bulk text at most), and the bulk request is answered in full afterwards."""
    client = grpcclient.InferenceServerClient(slow.grpc_url)
    config = client.get_model_config("tb_query", as_json=True)["config"]
    assert config["dynamic_batching"]["default_priority_level"] == "1"  # every request a query
    order: queue.Queue = queue.Queue()
    before = _encoded(client)
    client.async_infer("tb", _inputs([f"bulk {i}" for i in range(12)]),
                       callback=lambda result, error: order.put(("bulk", result, error)))
    _until(lambda: _encoded(client) > before, what="the bulk request's first text at the encoder")
    client.async_infer("tb_query", _inputs(["a query"]), callback=lambda result, error: order.put(("query", result,
                                                                                                   error)))
    first, second = order.get(timeout=60), order.get(timeout=60)
    assert [first[0], second[0]] == ["query", "bulk"], (first, second)
    assert first[2] is None and first[1].as_numpy("embedding").shape == (1, 384)
    assert second[2] is None and second[1].as_numpy("embedding").shape == (12, 384)


def test_shutdown_answers_the_running_and_the_waiting_requests_unavailable(minilm_repo: Path, tmp_path: Path) -> None:
    """SIGTERM (graceful stop) while one request's texts run through the one instance and another waits in Triton's
    queue: each caller gets exactly one answer, UNAVAILABLE (retry elsewhere), never INTERNAL, and the server exits."""
    from conftest import start_server

    out = tmp_path / "repo"
    _encoder(minilm_repo, out, "tb_onnx")
    _text_endpoint(minilm_repo, out, "tb", "tb_onnx", TritonMode(max_batch_size=64, instances=1, max_in_flight=1),
                   sub_batch_max=1)
    variant = CpuVariant(executor="costmodel", cost_a_us=CALL_S * 1e6, cost_b_us=0.0, encoder_instances=1,
                         text_params={}, text_instances=1,
                         batching={"tb_onnx": Batching(max_queue_delay_us=0, preferred_batch_sizes=())})
    srv = start_server(out, tmp_path / "state", variant=variant)
    answers: queue.Queue = queue.Queue()
    try:
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        before = _encoded(client)
        for tag, n in (("running", 20), ("waiting", 3)):
            client.async_infer("tb", _inputs([f"stop me {i}" for i in range(n)]),
                               callback=lambda result, error, tag=tag: answers.put((tag, result, error)))
            if tag == "running":
                _until(lambda: _encoded(client) > before, what="the first request's first text at the encoder")
        _until(lambda: _pending(srv.metrics_url, "tb") >= 1, what="the second request in Triton's queue")
        assert answers.empty()
    finally:
        srv.stop()
    got = {}
    for _ in range(2):
        tag, result, error = answers.get(timeout=60)
        assert tag not in got, f"{tag} answered twice"
        got[tag] = (result, error)
    for tag, (result, error) in got.items():
        assert result is None and error is not None, tag
        assert error.status() == "StatusCode.UNAVAILABLE", (tag, error.status(), error.message())
        assert "the server is shutting down" in error.message() or "Server is stopping" in error.message(), \
            (tag, error.message())
    assert answers.empty()

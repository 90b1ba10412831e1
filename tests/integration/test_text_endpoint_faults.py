"""The shipped text endpoint under faults, cancellation and request timeouts on a REAL tritonserver (issue 24).

The exported MiniLM pair copied as `tf` / `tf_onnx`, the text endpoint's code from this checkout, BLS to an
emulated encoder (cost model, 0.2 s a call, one instance) that answers an embedding one column short for any
sub-batch holding the token "poison" (the CPU stand-in's fault injection, parameter fault_token_id). The text
endpoint sends one text per sub-batch (sub_batch_max 1, max_in_flight 1), so a request of N texts is N
encoder calls one after the other, counted by the encoder's own statistics. Waits are bounded by progress.
"""
from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from bge_triton.repository import (
    Batching,
)
from bge_triton.server.cpu_variant import CpuVariant
from conftest import text_endpoint_repo

pytestmark = pytest.mark.integration

CALL_S = 0.2  # emulated encoder time per call


def _repo(src: Path, out: Path) -> Path:
    tok = Tokenizer.from_file(str(src / "minilm" / "1" / "tokenizer" / "tokenizer.json"))
    return text_endpoint_repo(src, out, "tf", "tests/integration/test_text_endpoint_faults.py",
                              {"fault_token_id": tok.token_to_id("poison"), "fault": "shape"})


@pytest.fixture(scope="module")
def server(minilm_repo: Path, server_factory, tmp_path_factory):
    repo = _repo(minilm_repo, tmp_path_factory.mktemp("text_faults_repo"))
    batching = {"tf_onnx": Batching(max_queue_delay_us=0, preferred_batch_sizes=())}
    variant = CpuVariant(executor="costmodel", cost_a_us=CALL_S * 1e6, cost_b_us=0.0, encoder_instances=1,
                         text_instances=1, batching=batching,
                         text_params={"sub_batch_max": "1", "max_in_flight": "1", "cancel_check_s": "0.02"})
    return server_factory(repo, variant=variant)


def _inputs(texts):
    inp = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return [inp]


def _encoded(client) -> int:
    """Texts the encoder ran (its own statistics: one text per call here)."""
    stats = client.get_inference_statistics("tf_onnx", as_json=True)["model_stats"]
    return sum(int(s.get("inference_count", 0)) for s in stats)


def _until(check, timeout_s: float = 60.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_an_encoder_answer_of_the_wrong_shape_fails_its_request_and_the_endpoint_serves_on(server) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        client.infer("tf", _inputs(["hello", "a poison apple"]))
    assert info.value.status() == "StatusCode.INTERNAL", info.value.message()
    assert "answered shape [1, 383]" in info.value.message() and "expected [1, 384]" in info.value.message()
    for _ in range(2):  # the dispatcher lived through it
        out = client.infer("tf", _inputs(["hello", "world"])).as_numpy("embedding")
        assert out.shape == (2, 384) and np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-3)


def test_a_cancelled_request_sends_none_of_its_waiting_texts_to_the_encoder(server) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = _encoded(client)
    answers: queue.Queue = queue.Queue()
    n = 12  # twelve encoder calls of 0.2 s if nothing is dropped
    call = client.async_infer("tf", _inputs([f"cancel me {i}" for i in range(n)]),
                              callback=lambda result, error: answers.put((result, error)))
    _until(lambda: _encoded(client) > before, what="the request's first text at the encoder")
    call.cancel()
    result, error = answers.get(timeout=60)
    assert result is None and "CANCELLED" in str(error.status()).upper(), (error.status(), error.message())
    # one more request at the same level: the pool is FIFO by the oldest text, so it runs after whatever of the
    # cancelled request was still to run; once it is answered, the encoder's count is final
    marker = client.infer("tf", _inputs(["marker"])).as_numpy("embedding")
    assert marker.shape == (1, 384)
    ran = _encoded(client) - before - 1
    assert 1 <= ran <= n // 2, f"{ran} of the cancelled request's {n} texts reached the encoder"


def test_a_request_timeout_shorter_than_the_default_is_honoured(server) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    before = _encoded(client)
    busy = client.async_infer("tf", _inputs([f"busy {i}" for i in range(4)]),
                              callback=lambda result, error: answers.put(("busy", result, error)))
    _until(lambda: _encoded(client) > before, what="the busy request's first text")  # 3 x 0.2 s still to run
    with pytest.raises(InferenceServerException) as info:
        client.infer("tf", _inputs(["in a hurry"]), timeout=100_000)  # its own 0.1 s; the config's default is 5 s
    assert info.value.status() == "StatusCode.UNAVAILABLE", info.value.message()
    assert "Request timeout expired" in info.value.message()
    assert "in the text endpoint's pool" in info.value.message()  # the pool's expiry, not Triton's own queue
    tag, result, error = answers.get(timeout=60)
    assert error is None and result.as_numpy("embedding").shape == (4, 384)
    del busy


def test_shutdown_answers_the_waiting_texts_unavailable(minilm_repo: Path, tmp_path: Path) -> None:
    """SIGTERM (graceful stop) while a request's texts wait in the pool: its caller gets one answer, UNAVAILABLE
    (503-class, retry elsewhere), not INTERNAL, and the server exits."""
    from conftest import start_server

    repo = _repo(minilm_repo, tmp_path / "repo")
    batching = {"tf_onnx": Batching(max_queue_delay_us=0, preferred_batch_sizes=())}
    variant = CpuVariant(executor="costmodel", cost_a_us=CALL_S * 1e6, cost_b_us=0.0, encoder_instances=1,
                         text_instances=1, batching=batching, text_params={"sub_batch_max": "1", "max_in_flight": "1"})
    srv = start_server(repo, tmp_path / "state", variant=variant)
    try:
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        answers: queue.Queue = queue.Queue()
        before = _encoded(client)
        client.async_infer("tf", _inputs([f"stop me {i}" for i in range(20)]),
                           callback=lambda result, error: answers.put((result, error)))
        _until(lambda: _encoded(client) > before, what="the request's first text at the encoder")
    finally:
        srv.stop()
    result, error = answers.get(timeout=60)
    assert result is None and error is not None
    assert error.status() == "StatusCode.UNAVAILABLE", (error.status(), error.message())
    assert "Server not ready" in error.message() or "unloading" in error.message()

"""Overload behind the text endpoint reaches its callers as UNAVAILABLE / 503 (issue 14), on a REAL server.

The shipped text endpoint (BLS, as on the GPU) in front of a slow emulated encoder (cost model,
1.5 s a call, one instance) with three text-endpoint instances of max_batch_size 1, and a burst of
twice as many texts: the instances make three BLS calls while the encoder runs one, and the texts left
in the text endpoint's queue make three more when the first call ends, so calls meet at the encoder
even when one caller or instance starts late (with exactly three texts, one clean-clone CI run of
2026-12-01 had every call find the encoder idle). Three encoder copies:
- `full_onnx`, queue of 1: the third call finds the queue full ("Exceeds maximum queue size");
- `slow_onnx`, queue timeout 100 ms: the queued calls expire behind the running one ("Request timeout expired");
- `bad_onnx`, a vocabulary of 50 ids: every call fails, a failure that is not overload (INTERNAL / 500).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from bge_triton.client.errors import KitError, Overloaded, classify
from bge_triton.repository import Batching, load_config, set_param, write_config
from bge_triton.server.cpu_variant import CpuVariant

pytestmark = pytest.mark.integration

CALLERS = 3  # = text-endpoint instances: three BLS calls in flight together
BURST = 2 * CALLERS  # texts sent at once
# `full` never times out (60 s), so its one way to turn a call away is the full queue.
COPIES = {"full": dict(max_queue_size=1, queue_timeout_us=60_000_000),
          "slow": dict(max_queue_size=64, queue_timeout_us=100_000), "bad": {}}


def _clone(src_repo: Path, out: Path) -> Path:
    """The exported minilm pair copied under each name of COPIES (files symlinked, configs rewritten)."""
    for copy in COPIES:
        for suffix in ("", "_onnx"):
            cfg = load_config(src_repo / f"minilm{suffix}")
            cfg.name = f"{copy}{suffix}"
            if suffix == "":
                set_param(cfg, "onnx_model", f"{copy}_onnx")
            elif copy == "bad":
                set_param(cfg, "vocab_size", 50)  # the cost model rejects ids >= 50: [CLS] is 101
            (out / cfg.name / "1").mkdir(parents=True)
            for item in (src_repo / f"minilm{suffix}" / "1").iterdir():
                os.symlink(item.resolve(), out / cfg.name / "1" / item.name)
            write_config(cfg, out / cfg.name / "config.pbtxt", "tests/integration/test_overload_status.py")
    return out


@pytest.fixture(scope="module")
def overload_server(minilm_repo: Path, server_factory, tmp_path_factory):
    repo = _clone(minilm_repo, tmp_path_factory.mktemp("overload_repo"))
    batching = {f"{c}_onnx": Batching(max_queue_delay_us=0, preferred_batch_sizes=(), **knobs)
                for c, knobs in COPIES.items()}
    batching.update({c: Batching(max_batch_size=1, max_queue_delay_us=0) for c in COPIES})
    variant = CpuVariant(executor="costmodel", cost_a_us=1_500_000, cost_b_us=0.0, encoder_instances=1,
                         text_instances=CALLERS, batching=batching)
    return server_factory(repo, variant=variant)


def _grpc(url: str, model: str, text: str):
    arr = np.array([[text.encode()]], dtype=object)
    inp = grpcclient.InferInput("text", [1, 1], "BYTES")
    inp.set_data_from_numpy(arr)
    try:
        return grpcclient.InferenceServerClient(url).infer(model, [inp]).as_numpy("embedding")
    except InferenceServerException as exc:
        return exc


def _http(url: str, model: str, text: str):
    arr = np.array([[text.encode()]], dtype=object)
    inp = httpclient.InferInput("text", [1, 1], "BYTES")
    inp.set_data_from_numpy(arr)
    try:
        return httpclient.InferenceServerClient(url, network_timeout=60).infer(model, [inp]).as_numpy("embedding")
    except InferenceServerException as exc:
        return exc


def _burst(server, model: str, protocol: str) -> tuple[list[np.ndarray], list[InferenceServerException]]:
    call, url = (_grpc, server.grpc_url) if protocol == "grpc" else (_http, server.http_url)
    with cf.ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(lambda i: call(url, model, f"text number {i}"), range(BURST)))
    served = [r for r in results if isinstance(r, np.ndarray)]
    return served, [r for r in results if isinstance(r, InferenceServerException)]


UNAVAILABLE = {"grpc": "StatusCode.UNAVAILABLE", "http": "503"}
INTERNAL = {"grpc": "StatusCode.INTERNAL", "http": "500"}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("copy, triton_message", [("full", "Exceeds maximum queue size"),
                                                  ("slow", "Request timeout expired")])
def test_encoder_overload_is_unavailable(overload_server, protocol: str, copy: str, triton_message: str) -> None:
    served, rejected = _burst(overload_server, copy, protocol)
    assert rejected, "expected the encoder to turn a call away"
    assert len(served) >= 1 and all(s.shape == (1, 384) for s in served)  # the running call still answers
    for exc in rejected:
        assert exc.status() == UNAVAILABLE[protocol], (exc.status(), exc.message())
        assert triton_message in exc.message() and f"encoder {copy}_onnx is overloaded" in exc.message()
        assert type(classify(exc)) is Overloaded  # the SDK retries it


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_encoder_failure_that_is_not_overload_is_internal(overload_server, protocol: str) -> None:
    served, failed = _burst(overload_server, "bad", protocol)
    assert not served and len(failed) == BURST
    for exc in failed:
        assert exc.status() == INTERNAL[protocol], (exc.status(), exc.message())
        assert "encoder bad_onnx failed" in exc.message() and "outside the vocabulary" in exc.message()
        assert type(classify(exc)) is KitError  # not retried

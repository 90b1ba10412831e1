"""The gateway's operations against REAL local tritonservers of their own (server_factory): /ready
follows a dead python stub, and each request's priority level reaches Triton's batcher."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx as httpx
import pytest
import starlette  # noqa: F401 - the extra this test needs
from test_gateway_openai import NAME, start

pytestmark = pytest.mark.integration


def test_dead_python_stub_turns_ready_to_503_naming_the_failure(server_factory, minilm_repo, tmp_path) -> None:
    """The chain behind /ready: the stubs die, the canary's embeddings fail, /ready turns 503 with the canary's error
    and stays there (Triton 2.51 does not restart a dead stub). How soon is the staleness rule's business
    (--ready-max-age after the last embedding, unit-tested on a fake clock in test_gateway_app); the wait here is
    only a hang bound."""
    from bge_triton.loadtest.stats import stub_pids

    srv = server_factory(minilm_repo)
    proc = start(tmp_path, srv.grpc_url, minilm_repo, "--canary-interval", "0.5", "--ready-max-age", "2")
    try:
        targets = [pid for pid, cmd in stub_pids(srv.proc.pid).items() if f"{NAME}_onnx" not in cmd]
        assert targets, "no python stub of the text endpoint under the server"
        for pid in targets:  # every instance of the text endpoint; children of the server we started
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120.0
        while (ready := httpx.get(proc.url + "/ready")).status_code == 200:
            assert time.monotonic() < deadline, "/ready still 200 two minutes after the stubs died"
            time.sleep(0.1)
        assert ready.status_code == 503 and ready.headers["retry-after"]
        error = ready.json()["error"]
        assert NAME in error and "no canary has run yet" not in error, error  # the canary's own failure, named
        for _ in range(3):  # it stays down: nothing answers for the dead stubs
            time.sleep(0.5)
            assert httpx.get(proc.url + "/ready").status_code == 503
        assert httpx.get(proc.url + "/health").status_code == 200  # the process itself is up
    finally:
        proc.stop()


def test_priorities_reach_triton(server_factory, minilm_repo, tmp_path) -> None:
    """Queries (and x-priority: high) arrive at Triton at level 1, passages at level 2 (verbose log)."""
    from bge_triton.repository import load_config

    config = load_config(minilm_repo / NAME)
    assert (config.dynamic_batching.priority_levels, config.dynamic_batching.default_priority_level) == (2, 2)
    srv = server_factory(minilm_repo, log_verbose=1)
    log = srv.settings.state_dir / "tritonserver.log"
    proc = start(tmp_path, srv.grpc_url, minilm_repo, "--canary-interval", "300", "--ready-max-age", "300")

    def counts() -> dict[int, int]:  # Triton logs each prepared request with its priority level
        text = log.read_text(errors="replace")
        return {p: len(re.findall(rf"model: {NAME}, [^\n]*?priority: {p},", text)) for p in (1, 2)}

    def expect(want: dict[int, int]) -> None:
        deadline = time.monotonic() + 10.0
        while counts() != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert counts() == want

    try:
        base = counts()
        assert base[2] >= 1  # the canary that made /ready 200 (the passages' level: a query would open query mode)
        post = lambda body, **kw: httpx.post(proc.url + "/v1/embeddings", timeout=60,  # noqa: E731
                                             json={"model": NAME, **body}, **kw)
        assert post({"input": ["a passage to index"]}).status_code == 200
        expect({1: base[1], 2: base[2] + 1})
        assert post({"input": ["an online query"], "input_type": "query"}).status_code == 200
        expect({1: base[1] + 1, 2: base[2] + 1})
        assert post({"input": ["urgent passage"]}, headers={"x-priority": "high"}).status_code == 200
        expect({1: base[1] + 2, 2: base[2] + 1})
    finally:
        proc.stop()

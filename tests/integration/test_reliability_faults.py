"""Overload and faults (loadtest.faults) on REAL tritonservers this module starts itself (ports 18200-18299; the
server killed and restarted: 18500-18599, a pool nothing else picks from): 3x overload with a deterministic
(costmodel) encoder, kill -9 of the server under load and a restart on the same ports, kill -9 of a python backend
stub, broken model files at start, and the launcher binding loopback only. `bge-triton chaos` runs the long versions.
Each failure message carries the scenario's whole record."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from bge_triton.loadtest import faults, harness
from bge_triton.loadtest.chaos import RETRY, broken_start, kill9_under_load, kill_stub, run_overload
from bge_triton.loadtest.faults import SAME_PORTS

pytestmark = pytest.mark.integration


def test_overload_3x_every_request_answered_and_recovered(minilm_repo: Path, tmp_path: Path) -> None:
    r = run_overload(minilm_repo, tmp_path / "state", overload_s=8.0, baseline_s=3.0, recovery_s=4.0)
    record = {k: v for k, v in r.items() if k != "shots"}
    # every request sent (counted by the load loop) answered with a result or an error: nothing lost, nothing hangs;
    # with retries off, each went to the wire once (counted by the client's transport seam)
    assert r["requests"] > 0 and r["answered"] == r["requests"] and r["lost"] == 0, record
    assert r["wire_attempts"] == r["requests"], record
    assert r["retry_answered"] == r["retry_requests"] > 0, record
    assert set(r["outcomes"]) <= {"ok", "Overloaded"}, r["outcomes"]  # a result or a 503/UNAVAILABLE
    assert r["overload_outcomes"].get("Overloaded", 0) > 0 and r["overload_outcomes"].get("ok", 0) > 0
    # recovered: once the load dropped, the server answers every request again (the latency bound of the queue
    # policy and the recovery time are measured and reported by `bge-triton chaos`, not asserted on a shared box)
    recovery = [x.outcome for x in r["shots"] if x.phase == "recovery"]
    assert len(recovery) >= 5 and recovery[-5:] == ["ok"] * 5, recovery
    assert r["server_alive_after"] and r["server_ready_after"]
    # retries are bounded per request (jitter is unit-tested in tests/unit/test_reliability_retry.py)
    assert r["retry_max_attempts_seen"] <= RETRY.max_attempts, r
    assert r["retry_attempts"] <= RETRY.max_attempts * r["retry_requests"]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_kill9_under_load_then_same_clients_recover(minilm_repo: Path, tmp_path: Path, protocol: str) -> None:
    r = kill9_under_load(minilm_repo, tmp_path / "state", protocol=protocol)
    assert r["restart"] == SAME_PORTS, r  # else it names who took the ports while the server was down
    assert r["answered"] == r["requests"], r  # every call of the load loop came back, with a result or an error
    assert r["all_workers_errored"], r  # how soon is measured and reported by `bge-triton chaos`
    assert set(r["error_kinds_after_kill"]) == {"ServerUnavailable"}, r
    assert r["same_clients_ok_after_restart_s"] is not None, r  # the SAME client objects succeed again
    assert r["ok_before_kill"] > 0


def test_a_restart_whose_port_was_taken_says_so(tmp_path: Path) -> None:
    """The restart after a kill -9 never moves to other ports (its clients know only these): when another process
    took one while the server was down, the outcome is 'ports taken' with the holder, not a server elsewhere."""
    (repo := tmp_path / "empty").mkdir()  # no models: ready once its listeners are up
    settings = harness.server_settings(repo, tmp_path / "state", port_range=faults.RESTART_PORTS, ready_timeout_s=120)
    with socket.socket() as other:
        other.bind(("127.0.0.1", settings.http_port))
        other.listen()
        srv, restart = faults.restart_on_same_ports(settings)
    if srv is not None:
        srv.stop()
    assert srv is None and restart.startswith(f"ports taken: {settings.http_port}: pid {os.getpid()} "), restart


def test_killed_stub_is_reported_not_hung(minilm_repo: Path, tmp_path: Path) -> None:
    """Triton 2.51 does NOT restart a dead python stub: the server and model stay 'ready' and every
    request to that model fails fast with 'Stub process ... is not healthy' until a restart."""
    r = kill_stub(minilm_repo, tmp_path / "state", watch_s=4.0)
    assert r["server_alive"]
    # every failure names the dead stub: none hangs (a hang would end in the client's Timeout, another message)
    assert r["errors"] and all("is not healthy" in m for _, _, m in r["errors"]), r["errors"]
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in r["listening"]), r["listening"]
    assert len(r["listening"]) == 3
    # Triton 2.51 does not replace a dead stub: the other instance serves, the dead one fails until the server is
    # restarted (`serve up --watch` does it; docs/reliability.md). new_stub: a stub pid not seen before the kill
    assert r["new_stub"] is False
    assert not r["outcome"]["recovered"] and r["outcome"]["restart"].startswith("none: Triton does not replace"), r


@pytest.mark.parametrize("case,message", [
    ("onnx_missing", "model.onnx is missing: run `bge-triton export --model-id"),
    ("tokenizer_corrupt", "failed to load 'minilm'"),
    ("config_corrupt", "has no field named \"max_batch_sise\""),
])
def test_broken_model_files_fail_server_up_clearly(minilm_repo: Path, tmp_path: Path, case: str,
                                                   message: str) -> None:
    r = broken_start(minilm_repo, tmp_path, case)
    assert r["rc"] != 0, r
    assert message in r["stderr"], r["stderr"][-3000:]
    if case != "config_corrupt":
        assert r["stderr"].index("Models that failed to load") < r["stderr"].index("Log tail"), r["stderr"]

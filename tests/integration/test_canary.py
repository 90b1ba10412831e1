"""A dead python stub is seen by a canary, not by /ready: `server status`, the SDK's health() and
`server up --watch` (which restarts the server) on the real local tritonserver."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bge_triton.client import EmbeddingClient, RetryPolicy
from bge_triton.server.canary import canary, canary_all
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import LocalServer, ServerSettings, free_ports

NAME = "minilm"
ENCODER = f"{NAME}_onnx"
COST = CpuVariant(executor="costmodel", cost_a_us=2000.0, cost_b_us=0.0)


def kill_stub(server_pid: int, model: str) -> int:
    """SIGKILL the python stub of `model`, a child of the server we started; returns its pid."""
    stubs = [p for p in psutil.Process(server_pid).children(recursive=True)
             if "triton_python_backend_stub" in " ".join(p.cmdline()) and f"/{model}/" in " ".join(p.cmdline())]
    assert stubs, f"no python stub of {model} under pid {server_pid}"
    for stub in stubs:
        os.kill(stub.pid, signal.SIGKILL)
    return stubs[0].pid


def test_dead_stub_fails_the_canary_status_and_health(minilm_repo: Path, tmp_path: Path) -> None:
    http, grpc, metrics = free_ports(3)
    settings = ServerSettings(repository=minilm_repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                              state_dir=tmp_path / "state", variant=COST)
    with LocalServer(settings) as srv:
        base = f"http://{srv.http_url}"
        assert {r.model: r.ok for r in canary_all(base)} == {NAME: True, ENCODER: True}
        with EmbeddingClient(srv.grpc_url, model=NAME, retry=RetryPolicy.off(), timeout_s=5.0) as client:
            assert client.health()["ok"]
            kill_stub(srv.proc.pid, ENCODER)
            time.sleep(1.0)
            report = client.health()
        assert report["model_ready"] and not report["ok"], report  # /ready says yes; the canary says no
        assert "not healthy" in report["error"] or "Stub" in report["error"], report["error"]
        results = {r.model: r for r in canary_all(base)}
        assert not results[ENCODER].ok and "not healthy" in results[ENCODER].error, results[ENCODER]
        status = subprocess.run([sys.executable, "-m", "bge_triton.server", "status", "--state-dir",
                                 str(settings.state_dir)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 3, status.stdout + status.stderr
        assert f"{ENCODER}: CANARY FAILED" in status.stdout, status.stdout


def _line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    """Read the watcher's stdout until a line containing `needle` (fail with what it printed)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            if needle in line:
                return line
    pytest.fail(f"no line with {needle!r} within {timeout_s} s; printed:\n{''.join(seen)}")


def test_watch_restarts_a_server_whose_stub_died(minilm_repo: Path, tmp_path: Path) -> None:
    http, grpc, metrics = free_ports(3)
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(minilm_repo),
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--executor", "costmodel", "--state-dir", str(state), "--watch", "1"]
    watcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _line(watcher, "tritonserver ready", 180)
        first_pid = json.loads((state / "server.json").read_text())["pid"]
        kill_stub(first_pid, ENCODER)
        _line(watcher, "watch: restarting tritonserver", 30)
        _line(watcher, "watch: ready again", 180)
        second_pid = json.loads((state / "server.json").read_text())["pid"]
        assert second_pid != first_pid and not psutil.pid_exists(first_pid)
        assert canary(f"http://127.0.0.1:{http}", ENCODER).ok
    finally:
        watcher.send_signal(signal.SIGTERM)  # the watcher stops its server on SIGTERM
        watcher.wait(timeout=60)
    assert not psutil.pid_exists(json.loads((state / "server.json").read_text())["pid"])

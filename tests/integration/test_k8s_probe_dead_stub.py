"""The Triton pod's probe command (deploy/k8s/base/canary.sh) on a real server: it passes on a healthy one, and
it fails once the text endpoint's python stubs are killed, while /v2/health/ready still answers 200 (Triton
2.51 does not restart a dead stub): the reason the Deployment's readiness and liveness run the canary."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
from tests.deploy.ci import must_run

from bge_triton.loadtest.stats import stub_pids
from bge_triton.repository import get_param, load_repository

must_run(None if shutil.which("curl") else "no curl", "the Kubernetes probe test")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("curl") is None, reason="canary.sh needs curl: apt-get install curl")]

CANARY = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "canary.sh"


def canary(srv, model: str, dim: int, input_name: str, repeat: int = 4) -> subprocess.CompletedProcess:
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "CANARY_URL": f"http://{srv.http_url}", "CANARY_MODEL": model, "CANARY_DIM": str(dim),
           "CANARY_INPUT": input_name, "CANARY_REPEAT": str(repeat), "CANARY_TIMEOUT_S": "5"}
    return subprocess.run(["sh", str(CANARY)], env=env, capture_output=True, text=True, timeout=60)


def status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status


def test_canary_fails_on_a_dead_stub_that_health_ready_misses(minilm_repo: Path, server_factory) -> None:
    configs = load_repository(minilm_repo)
    name, text = next((n, c) for n, c in configs.items() if get_param(c, "onnx_model"))
    srv = server_factory(minilm_repo)  # its own server: this test breaks it
    args = (name, text.output[0].dims[0], text.input[0].name)
    ok = canary(srv, *args)
    assert ok.returncode == 0, ok.stderr
    assert f"4 embeddings of {text.output[0].dims[0]} dims" in ok.stdout

    stubs = [pid for pid, cmd in stub_pids(srv.proc.pid).items() if f"/{name}/1/model.py" in cmd]
    assert stubs, stub_pids(srv.proc.pid)
    procs = [psutil.Process(pid) for pid in stubs]
    for proc in procs:
        proc.send_signal(signal.SIGKILL)  # children of the server this test started
    psutil.wait_procs(procs, timeout=10)  # gone (or a zombie the server has not reaped yet)

    assert status(f"http://{srv.http_url}/v2/health/ready") == 200  # the known limit: still "ready"
    assert status(f"http://{srv.http_url}/v2/models/{name}/ready") == 200
    dead = canary(srv, *args)
    assert dead.returncode == 1 and "is not healthy" in dead.stderr, (dead.returncode, dead.stdout, dead.stderr)


def test_one_dead_instance_of_two_fails_every_probe(minilm_repo: Path, server_factory) -> None:
    """Why the canary sends four requests: the instances take turns, so one request sees a dead instance only
    every other probe; four consecutive ones reach both."""
    configs = load_repository(minilm_repo)
    name, text = next((n, c) for n, c in configs.items() if get_param(c, "onnx_model"))
    srv = server_factory(minilm_repo)
    args = (name, text.output[0].dims[0], text.input[0].name)
    stubs = [pid for pid, cmd in stub_pids(srv.proc.pid).items() if f"/{name}/1/model.py" in cmd]
    assert len(stubs) >= 2, "the text endpoint needs two instances for this case"
    victim = psutil.Process(stubs[0])
    victim.send_signal(signal.SIGKILL)  # one instance of the server this test started
    psutil.wait_procs([victim], timeout=10)
    assert [canary(srv, *args).returncode for _ in range(5)] == [1] * 5
    single = [canary(srv, *args, repeat=1).returncode for _ in range(6)]
    assert 0 in single and 1 in single, single  # one request alone passes on the live instance

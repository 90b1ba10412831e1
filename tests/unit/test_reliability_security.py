"""Issue 7, security and retry behaviour without a server: nothing in export/ loads code from a model
directory, the launcher binds loopback only, the compose deployment restricts admin APIs and model
control, and the client's retry backoff is bounded and jittered (no synchronised retry storms)."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import yaml

from bge_triton.client import RetryPolicy
from bge_triton.server.launcher import ServerSettings, build_command

REPO = Path(__file__).resolve().parents[2]


def test_no_trust_remote_code_in_the_exporter() -> None:
    offenders = []
    for path in sorted((REPO / "export").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"trust_remote_code\s*=\s*True", line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "code from a model directory must never run:\n" + "\n".join(offenders)


def test_launcher_binds_loopback_only_and_disables_model_control(tmp_path: Path) -> None:
    cmd = build_command(ServerSettings(state_dir=tmp_path), tmp_path / "backends", tmp_path / "repo")
    addresses = {a.split("=", 1)[1] for a in cmd if re.match(r"--(http|grpc|metrics)-address=", a)}
    assert addresses == {"127.0.0.1"}, cmd
    assert "--model-control-mode=none" in cmd


def test_compose_restricts_admin_apis_and_model_control() -> None:
    compose = REPO / "docker-compose.yml"
    if not compose.exists():
        pytest.skip("docker-compose.yml not written yet")
    triton = yaml.safe_load(compose.read_text())["services"]["triton"]
    args = [str(a) for a in triton["command"]]
    assert "--model-control-mode=none" in args
    for flag in ("--http-restricted-api=", "--grpc-restricted-protocol="):
        value = next(a for a in args if a.startswith(flag))
        assert {"model-repository", "shared-memory", "logging", "trace"} <= set(value[len(flag):].split(":")[0].split(","))
    for port in triton["ports"]:
        assert str(port).startswith("${BIND_ADDR:-127.0.0.1}:"), port  # loopback unless the operator says
    repo_mount = next(v for v in triton["volumes"] if isinstance(v, dict) and v.get("target") == "/models")
    assert repo_mount.get("read_only") is True


def test_retry_backoff_is_bounded_and_jittered() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=0.5, total_s=5.0)
    rng = random.Random(1)
    for k in range(6):
        delays = [policy.backoff(k, rng) for _ in range(500)]
        cap = min(0.5, 0.05 * 2 ** k)
        assert max(delays) <= cap and min(delays) >= 0
        assert len(set(delays)) > 490  # full jitter: callers do not retry in step
        assert 0.4 * cap < sum(delays) / len(delays) < 0.6 * cap
    from bge_triton.client.errors import Overloaded

    err = Overloaded("queue full")
    attempts = 1
    while policy.next_delay(err, attempts, 0.0, rng) is not None:
        attempts += 1
    assert attempts == policy.max_attempts  # never more than max_attempts in all

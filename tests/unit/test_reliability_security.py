"""Issue 7, security and retry behaviour without a server: nothing in export/ loads code from a model
directory, the launcher binds loopback only, the compose deployment keeps model control off and the server
image's entrypoint restricts admin APIs behind a given or generated key, and the client's retry backoff is
bounded and jittered (no synchronised retry storms)."""
from __future__ import annotations

import random
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from bge_triton.client import RetryPolicy
from bge_triton.errors import ServerNotReady
from bge_triton.paths import IMPORT_ROOT
from bge_triton.server.launcher import ServerSettings, build_command, server_env, stub_venv

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


def test_minimal_stub_env_hides_the_kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(IMPORT_ROOT))
    monkeypatch.setenv("PYTHONHOME", "/somewhere")
    kit = server_env()
    assert str(IMPORT_ROOT) in kit["PYTHONPATH"].split(":")  # the dev default: kit and repository visible
    env = server_env(tmp_path / "venv")
    assert "PYTHONPATH" not in env and "PYTHONHOME" not in env and env["PYTHONNOUSERSITE"] == "1"
    assert env["PATH"].split(":")[0] == str(tmp_path / "venv" / "bin")  # the stub's python3 is that venv's
    assert env["LD_LIBRARY_PATH"] == kit["LD_LIBRARY_PATH"]  # same libpython for the stub


def test_stub_venv_names_a_package_pip_cannot_install(tmp_path: Path) -> None:
    with pytest.raises(ServerNotReady, match=r"numpy==0\.0\.0\.0.*pip"):
        stub_venv(("numpy==0.0.0.0",), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing half-built left behind


ENTRY = REPO / "deploy" / "triton-entrypoint.sh"
ADMIN_APIS = "model-repository,shared-memory,logging,trace"


def test_compose_keeps_model_control_behind_the_key_and_loopback() -> None:
    triton = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["triton"]
    args = [str(a) for a in triton["command"]]
    # explicit model control (tune --apply loads configs), started by the entrypoint that restricts the
    # repository API to the admin key (test_entrypoint_* below)
    assert "--model-control-mode=explicit" in args and args[0] == "tritonserver"
    assert not [a for a in args if "restricted" in a]  # the entrypoint appends them, with the key
    for port in triton["ports"]:
        assert str(port).startswith("${BIND_ADDR:-127.0.0.1}:"), port  # loopback unless the operator says
    assert "${MODEL_REPOSITORY:-./model_repository}:/models:ro" in triton["volumes"]


def _entry(tmp_path: Path, *command: str, script: Path = ENTRY, **env: str) -> subprocess.CompletedProcess:
    """Run an entry script with sh, a fake `tritonserver` on PATH that prints its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "tritonserver"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SECRETS_DIR": str(tmp_path / "secrets")}
    return subprocess.run(["sh", str(script), *command], capture_output=True, text=True, timeout=30,
                          env={**base, **env})


def test_entrypoint_generates_and_keeps_an_admin_key(tmp_path: Path) -> None:
    first = _entry(tmp_path, "tritonserver", "--model-repository=/models")
    assert first.returncode == 0, first.stderr
    key_file = tmp_path / "secrets" / "admin_key"
    key = key_file.read_text()
    assert re.fullmatch(r"[A-Za-z0-9]{40}", key) and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert first.stdout.splitlines() == ["--model-repository=/models",
                                         f"--http-restricted-api={ADMIN_APIS}:triton-admin-key={key}",
                                         f"--grpc-restricted-protocol={ADMIN_APIS}:triton-admin-key={key}"]
    assert _entry(tmp_path, "tritonserver").stdout == "".join(first.stdout.splitlines(True)[1:])  # kept
    other = tmp_path / "other"
    other.mkdir()
    assert _entry(other, "tritonserver").stdout != _entry(tmp_path, "tritonserver").stdout  # random per volume


def test_entrypoint_set_key_wins_and_bad_keys_stop_the_start(tmp_path: Path) -> None:
    given = "k" * 20
    out = _entry(tmp_path, "tritonserver", TRITON_ADMIN_KEY=given, TRITON_ADMIN_HEADER="x-ops")
    assert out.returncode == 0 and f"--http-restricted-api={ADMIN_APIS}:x-ops={given}" in out.stdout.splitlines()
    assert not (tmp_path / "secrets" / "admin_key").exists()
    for key, needle in (("short", "use at least 16"), ("a" * 20 + "=:", "outside A-Z")):
        bad = _entry(tmp_path, "tritonserver", TRITON_ADMIN_KEY=key)
        assert bad.returncode == 64 and needle in bad.stderr and bad.stdout == "", bad
    other = _entry(tmp_path, "echo", "hello")  # another command runs as given, without Triton's flags
    assert other.returncode == 0 and other.stdout == "hello\n"


def test_grafana_password_generated_and_kept_unless_given(tmp_path: Path) -> None:
    script = REPO / "deploy" / "grafana-entrypoint.sh"
    show = ("sh", "-c", "echo $GF_SECURITY_ADMIN_PASSWORD")
    made = _entry(tmp_path, *show, script=script)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == (tmp_path / "secrets" / "admin_password").read_text()
    assert _entry(tmp_path, *show, script=script).stdout == made.stdout
    assert _entry(tmp_path, *show, script=script, GF_SECURITY_ADMIN_PASSWORD="given").stdout == "given\n"


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

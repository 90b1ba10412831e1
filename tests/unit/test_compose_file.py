"""docker-compose.yml checked statically: it validates, and it has the GPU, health and security bits."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / "deploy" / ".env.example"
ADMIN_APIS = {"model-repository", "shared-memory", "logging", "trace"}
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose binary absent: apt-get install -y docker-compose (Debian's 1.29)")


def _compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "GRAFANA_", "BIND_ADDR"))}
    env.update(extra)
    return env


def _config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [DOCKER_COMPOSE, "-f", str(COMPOSE), "--project-directory", str(REPO), *args, "config"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env or _compose_env())


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def resolved() -> dict:
    """The file as docker-compose resolves it with deploy/.env.example and every profile on."""
    if DOCKER_COMPOSE is None:
        pytest.skip("docker-compose binary absent: apt-get install -y docker-compose (Debian's 1.29)")
    proc = _config("--env-file", str(ENV_EXAMPLE), "--profile", "export", "--profile", "monitoring",
                   "--profile", "loadtest")
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@needs_compose
def test_docker_compose_config_validates(resolved: dict) -> None:
    assert set(resolved["services"]) == {"triton", "exporter", "prometheus", "grafana",
                                         "locust-master", "locust-worker"}


@needs_compose
def test_missing_admin_key_is_an_error_not_an_open_server() -> None:
    proc = _config(env=_compose_env(GRAFANA_ADMIN_PASSWORD="x"))
    assert proc.returncode != 0
    assert "TRITON_ADMIN_KEY" in proc.stderr


@needs_compose
def test_ports_bind_to_loopback_unless_configured(resolved: dict) -> None:
    for name, svc in resolved["services"].items():
        for port in svc.get("ports", []):
            spec = port if isinstance(port, str) else f"{port.get('host_ip')}:{port.get('published')}"
            assert spec.startswith("127.0.0.1:"), f"{name} publishes {spec} beyond loopback"
    proc = _config(env=_compose_env(TRITON_ADMIN_KEY="k", GRAFANA_ADMIN_PASSWORD="p", BIND_ADDR="0.0.0.0"))
    assert proc.returncode == 0, proc.stderr
    assert "0.0.0.0:8000:8000" in proc.stdout


def test_triton_gpu_reservation_and_image(raw: dict) -> None:
    triton = raw["services"]["triton"]
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d.get("count", "all")
               for d in devices)
    assert "gpu" in json.dumps(raw["services"]["exporter"]["deploy"])


def test_triton_command_flags(raw: dict) -> None:
    cmd = raw["services"]["triton"]["command"]
    assert cmd[0] == "tritonserver"
    assert "--model-repository=/models" in cmd
    assert "--model-control-mode=none" in cmd
    assert "--strict-readiness=true" in cmd
    assert "--metrics-config=summary_latencies=true" in cmd  # p99 panels need the summaries
    for flag in ("--http-restricted-api=", "--grpc-restricted-protocol="):
        (value,) = [c[len(flag):] for c in cmd if c.startswith(flag)]
        apis, _, header = value.partition(":")  # Triton 2.51: <apis>:<key>=<value>
        assert set(apis.split(",")) >= ADMIN_APIS
        assert not {"inference", "health"} & set(apis.split(","))
        key, _, secret = header.partition("=")
        assert key and "${TRITON_ADMIN_KEY:?" in secret


def test_model_repository_read_only_and_engine_cache_volume(raw: dict) -> None:
    triton = raw["services"]["triton"]
    mounts = {v["target"]: v for v in triton["volumes"]}
    assert mounts["/models"]["source"] == "./model_repository" and mounts["/models"]["read_only"] is True
    assert mounts["/engine_cache"]["type"] == "volume"
    assert mounts["/engine_cache"]["source"] in raw["volumes"]
    exporter = {v["target"]: v for v in raw["services"]["exporter"]["volumes"]}
    assert not exporter["/models"].get("read_only", False)  # the exporter writes the repository


def test_python_backend_resources_and_healthcheck(raw: dict) -> None:
    triton = raw["services"]["triton"]
    assert triton["shm_size"]
    assert triton["ulimits"]["memlock"] == -1 and triton["ulimits"]["stack"] == 67108864
    hc = triton["healthcheck"]
    assert "curl" in hc["test"] and any("/v2/health/ready" in t for t in hc["test"])
    assert hc["start_period"]


def test_profiles(raw: dict) -> None:
    svcs = raw["services"]
    assert "profiles" not in svcs["triton"]
    assert svcs["exporter"]["profiles"] == ["export"]
    cmd = svcs["exporter"]["command"]
    assert cmd[:3] == ["python", "-m", "bge_triton.export"] and "--precision" in cmd and "fp16" in cmd
    assert (REPO / svcs["exporter"]["build"]["dockerfile"]).exists()
    assert svcs["prometheus"]["profiles"] == svcs["grafana"]["profiles"] == ["monitoring"]
    assert svcs["locust-master"]["profiles"] == svcs["locust-worker"]["profiles"] == ["loadtest"]
    assert "--master" in svcs["locust-master"]["command"]
    worker = svcs["locust-worker"]
    assert "--worker" in worker["command"] and "ports" not in worker and "container_name" not in worker


def test_env_example_names_every_required_variable() -> None:
    text = ENV_EXAMPLE.read_text()
    for var in ("TRITON_ADMIN_KEY", "TRITON_ADMIN_HEADER", "BIND_ADDR", "GRAFANA_ADMIN_PASSWORD"):
        assert f"\n{var}=" in text
    assert "BIND_ADDR=127.0.0.1" in text

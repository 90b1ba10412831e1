"""docker-compose.yml checked statically: it validates with nothing set, `up` alone exports then serves, and it
has the GPU (docker-compose.override.yml), health and security bits; docker-compose.cpu.yml drops the GPU. The
exporter's command (`bge-triton export`, the reranker on a setting): tests/unit/test_compose_reranker.py; the
export's skip rule and --instance-kind: tests/unit/test_export_prepare.py. The stack itself runs in tests/deploy
(`make deploy-test`)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tests.deploy.ci import must_run

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
GPU = REPO / "docker-compose.override.yml"
CPU = REPO / "docker-compose.cpu.yml"
ENV_EXAMPLE = REPO / "deploy" / ".env.example"
PROFILES = ("--profile", "monitoring", "--profile", "loadtest")
DOCKER_COMPOSE = shutil.which("docker-compose")
must_run(None if DOCKER_COMPOSE else "no docker-compose", "the compose file tests")
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose binary absent: apt-get install -y docker-compose (Debian's 1.29)")


def _compose_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any variable docker-compose.yml reads, plus `extra`."""
    names = {n for f in (COMPOSE, GPU, CPU) for n in re.findall(r"\$\{(\w+)", f.read_text())}
    env = {k: v for k, v in os.environ.items() if k not in names and not k.startswith("COMPOSE_")}
    env.update(extra)
    return env


def _config(*args: str, env_file: Path, env: dict[str, str] | None = None, quiet: bool = False,
            files: tuple[Path, ...] = (COMPOSE, GPU)) -> subprocess.CompletedProcess:
    """`docker-compose config`; the default files are what a plain `docker compose up` reads (+ the override)."""
    cmd = [DOCKER_COMPOSE, *[a for f in files for a in ("-f", str(f))], "--project-directory", str(REPO),
           "--env-file", str(env_file), *args, "config", *(["-q"] if quiet else [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env or _compose_env())


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def no_env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty env file: stands for 'no .env' even where a developer keeps one in the repository."""
    path = tmp_path_factory.mktemp("compose") / "empty.env"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def resolved(no_env_file: Path) -> dict:
    """The file as docker-compose resolves it with no .env, no variable set and every profile on."""
    if DOCKER_COMPOSE is None:
        pytest.skip("docker-compose binary absent: apt-get install -y docker-compose (Debian's 1.29)")
    proc = _config(*PROFILES, env_file=no_env_file)
    assert proc.returncode == 0, proc.stderr
    assert "variable is not set" not in proc.stderr, proc.stderr  # every ${VAR} has a default
    return yaml.safe_load(proc.stdout)


@needs_compose
def test_config_validates_with_no_env_and_no_variables(resolved: dict, no_env_file: Path) -> None:
    assert set(resolved["services"]) == {"triton", "exporter", "gateway", "prometheus", "grafana",
                                         "locust-master", "locust-worker"}
    proc = _config(env_file=no_env_file, quiet=True)  # plain `up`: no profile
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert _config(*PROFILES, env_file=ENV_EXAMPLE, quiet=True).returncode == 0  # the example, copied as is


@needs_compose
def test_up_alone_exports_then_serves(resolved: dict) -> None:
    svcs = resolved["services"]
    assert "profiles" not in svcs["triton"] and "profiles" not in svcs["exporter"]
    assert svcs["triton"]["depends_on"] == {"exporter": {"condition": "service_completed_successfully"}}
    assert "profiles" not in svcs["gateway"]  # up serves the OpenAI API too, once Triton is healthy
    assert svcs["gateway"]["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert "--triton=triton:8001" in svcs["gateway"]["command"]
    cmd, env = svcs["exporter"]["command"], svcs["exporter"]["environment"]
    assert cmd[:2] == ["sh", "-ec"] and cmd[2].startswith("bge-triton export ")  # test_compose_reranker.py runs it
    assert env["EXPORT_PRECISION"] == "fp16" and env["INSTANCE_KIND"] == "gpu" and env["RERANK_MODEL"] == ""
    assert svcs["exporter"]["restart"] == "no"


@needs_compose
def test_ports_bind_to_loopback_unless_configured(resolved: dict, no_env_file: Path) -> None:
    published = [(name, port) for name, svc in resolved["services"].items() for port in svc.get("ports", [])]
    assert len(published) == 7  # triton http/grpc/metrics, gateway, prometheus, grafana, locust-master
    for name, port in published:
        spec = port if isinstance(port, str) else f"{port.get('host_ip')}:{port.get('published')}"
        assert spec.startswith("127.0.0.1:"), f"{name} publishes {spec} beyond loopback"
    proc = _config(env_file=no_env_file, env=_compose_env(BIND_ADDR="0.0.0.0"))
    assert proc.returncode == 0, proc.stderr
    assert "0.0.0.0:8000:8000" in proc.stdout


@needs_compose
def test_base_images_reach_every_build(no_env_file: Path) -> None:
    env = _compose_env(TRITON_IMAGE="registry.example/tritonserver:25.01-py3", PYTHON_IMAGE="registry.example/py:3.11")
    proc = _config(*PROFILES, env_file=no_env_file, env=env)
    assert proc.returncode == 0, proc.stderr
    svcs = yaml.safe_load(proc.stdout)["services"]
    assert svcs["triton"]["build"]["args"] == {"TRITON_IMAGE": "registry.example/tritonserver:25.01-py3"}
    assert svcs["gateway"]["build"]["args"] == {"PYTHON_IMAGE": "registry.example/py:3.11"}
    for name, target in (("exporter", "exporter"), ("locust-master", "loadtest"), ("locust-worker", "loadtest")):
        build = svcs[name]["build"]
        assert build["args"] == {"PYTHON_IMAGE": "registry.example/py:3.11",
                                 "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}, name
        assert build["target"] == target and build["dockerfile"] == "deploy/Dockerfile.kit", name
    assert svcs["exporter"]["image"] == "bge-triton-kit:local"
    assert svcs["locust-master"]["image"] == svcs["locust-worker"]["image"] == "bge-triton-loadtest:local"


@needs_compose
def test_only_triton_reserves_the_gpu_and_the_cpu_override_reserves_none(resolved: dict, no_env_file: Path) -> None:
    assert [n for n, svc in resolved["services"].items() if "deploy" in svc] == ["triton"]
    devices = resolved["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    proc = _config(*PROFILES, env_file=no_env_file, files=(COMPOSE, CPU))
    assert proc.returncode == 0 and "variable is not set" not in proc.stderr, proc.stderr
    cpu = yaml.safe_load(proc.stdout)["services"]
    assert "driver: nvidia" not in proc.stdout and not [n for n, svc in cpu.items() if "deploy" in svc]
    env = cpu["exporter"]["environment"]
    assert env["INSTANCE_KIND"] == "cpu" and env["EXPORT_PRECISION"] == env["RERANK_PRECISION"] == "fp32"
    assert "--allow-gpu-metrics=false" in cpu["triton"]["command"]
    assert [c for c in cpu["triton"]["command"] if c != "--allow-gpu-metrics=false"] == \
        [c for c in resolved["services"]["triton"]["command"] if c != "--allow-gpu-metrics=true"]
    assert cpu["gateway"] == resolved["services"]["gateway"]  # the rest of the stack is the same


def test_no_variable_is_mandatory() -> None:
    text = COMPOSE.read_text()
    refs = re.findall(r"\$\{(\w+)([^}]*)\}", text)
    assert refs
    assert [f"${{{n}{rest}}}" for n, rest in refs if not rest.startswith(":-")] == []  # no ${VAR:?} / bare ${VAR}
    documented = set(re.findall(r"^(\w+)=", ENV_EXAMPLE.read_text(), flags=re.M))
    assert {n for n, _ in refs} - documented == set()  # every setting is in deploy/.env.example
    assert "BIND_ADDR=127.0.0.1" in ENV_EXAMPLE.read_text()


def test_triton_builds_the_server_image(raw: dict) -> None:
    triton = raw["services"]["triton"]
    assert (REPO / triton["build"]["context"] / triton["build"]["dockerfile"]) == REPO / "deploy" / "Dockerfile.server"
    assert triton["pull_policy"] == "build"  # never a same-named image from a registry
    assert "deploy" not in triton and "deploy" not in raw["services"]["exporter"]  # the GPU: the override file
    gpu = yaml.safe_load(GPU.read_text())["services"]
    assert list(gpu) == ["triton"] and "nvidia" in json.dumps(gpu["triton"]["deploy"])


def test_triton_command_flags(raw: dict) -> None:
    cmd = raw["services"]["triton"]["command"]
    assert cmd[0] == "tritonserver"  # the entrypoint appends the admin-API restriction to this command only
    assert "--model-repository=/models" in cmd
    # explicit control with every model loaded at start: tune --apply / bench seed --url load configs through the
    # repository API, which the entrypoint puts behind the admin key
    assert "--model-control-mode=explicit" in cmd and "--load-model=*" in cmd
    assert "--strict-readiness=true" in cmd
    assert "--metrics-config=summary_latencies=true" in cmd  # p99 panels need the summaries
    assert not [c for c in cmd if "restricted" in c]  # one place: deploy/triton-entrypoint.sh


def test_model_repository_read_only_and_volumes(raw: dict) -> None:
    triton = raw["services"]["triton"]
    mounts = {v["target"]: v for v in triton["volumes"] if isinstance(v, dict)}
    # the repository: ./model_repository, which a clone holds (model_repository/.gitkeep), in the short syntax that
    # makes a missing folder on Compose 1.29 and v2 alike; read-only for Triton and the gateway, read-write for the
    # exporter
    repo = "${MODEL_REPOSITORY:-./model_repository}"
    assert f"{repo}:/models:ro" in triton["volumes"]
    tracked = subprocess.run(["git", "ls-files", "model_repository"], cwd=REPO, capture_output=True, text=True)
    assert tracked.stdout.split() == ["model_repository/.gitkeep"]
    assert f"{repo}:/models:ro" in raw["services"]["gateway"]["volumes"]
    assert f"{repo}:/models" in raw["services"]["exporter"]["volumes"]
    for service in raw["services"].values():
        assert not [v for v in service.get("volumes", []) if isinstance(v, dict) and v.get("type") == "bind"]
    for target in ("/engine_cache", "/secrets"):
        assert mounts[target]["type"] == "volume" and mounts[target]["source"] in raw["volumes"]
    assert " -e " not in (REPO / "deploy" / "Dockerfile.kit").read_text()


def test_dockerignore_files_agree_and_keep_artefacts_out() -> None:
    root = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    for name in ("Dockerfile.kit.dockerignore", "Dockerfile.gateway.dockerignore"):
        assert (REPO / "deploy" / name).read_text().splitlines() == root, name
    for pattern in (".venv", ".git", ".kit", "model_repository", "**/*.onnx", "**/*.onnx_data", "**/*.safetensors"):
        assert pattern in root
    # the canonical repository (package data of the wheel) stays in the context: only its export outputs are out
    assert "src" not in root and not [p for p in root if p.rstrip("/") == "src/bge_triton/model_repository"]


def test_python_backend_resources_and_healthcheck(raw: dict) -> None:
    triton = raw["services"]["triton"]
    assert triton["shm_size"]
    assert triton["ulimits"]["memlock"] == -1 and triton["ulimits"]["stack"] == 67108864
    hc = triton["healthcheck"]
    # healthy = ready + the reference vectors verified, by the script the server image carries
    assert hc["test"] == ["CMD", "sh", "/opt/bge-triton/verify-ready.sh"]
    server = (REPO / "deploy" / "Dockerfile.server").read_text()
    assert "deploy/verify-ready.sh" in server
    assert "src/bge_triton/verify/standalone.py /opt/bge-triton/bge_triton_verify.py" in server
    assert "src/bge_triton/verify/rerank_standalone.py /opt/bge-triton/bge_triton_rerank_verify.py" in server
    assert "deploy/verify-rerank.sh" in server  # verify-ready.sh sources it when the repository holds the reranker
    assert hc["start_period"] and int(hc["timeout"].rstrip("s")) >= 15


def test_profiles(raw: dict) -> None:
    svcs = raw["services"]
    assert (REPO / svcs["exporter"]["build"]["dockerfile"]).exists()
    assert svcs["prometheus"]["profiles"] == svcs["grafana"]["profiles"] == ["monitoring"]
    assert svcs["locust-master"]["profiles"] == svcs["locust-worker"]["profiles"] == ["loadtest"]
    assert "--master" in svcs["locust-master"]["command"]
    worker = svcs["locust-worker"]
    assert "--worker" in worker["command"] and "ports" not in worker and "container_name" not in worker

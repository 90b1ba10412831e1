"""`docker compose up` of the shipped stack, run here: images built from a clean archive, containers on podman.

Builds the local base and the stand-ins of python:3.11-slim and tritonserver:24.10-py3 when podman lacks them
(deploy/standins/build.sh; how they differ from the real images: deploy/standins/README.md), every image of the
repository from `git archive` of the tree under test (deploy/build-images.sh; DEPLOY_TEST_TREE=<tree-ish> or
`worktree`, default HEAD), then runs docker-compose 1.29 against podman's Docker API with the CPU override
(docker-compose.cpu.yml: no GPU reservation) and tests/deploy/compose.standin.yml. That overlay SWAPS THE ENCODER:
the stand-in has no onnxruntime backend, so Triton serves the CPU variant's python model of the exported encoder
(bge_triton.server.cpu_variant), where the real image runs the same ONNX file in its onnxruntime backend.
The exporter exports synthetic:bge-small-zh (random weights, the real architecture and vocabulary size) in FP32,
and, with the reranker on (RERANK_MODEL), synthetic:bge-reranker-small as bge_reranker: Triton serves both, its
healthcheck verifies both, the gateway answers /v1/rerank.

Times of each phase go to DEPLOY_TEST_TIMINGS (default .kit/deploy-test-timings.txt); nothing here asserts on them.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tests.deploy.ci import must_run
from tests.deploy.stack import (
    REPO,
    ApiService,
    HealthDriver,
    Project,
    free_ports,
    http,
    run,
    wait_until,
    why_podman_cannot_run,
)

pytestmark = pytest.mark.deploy
REASON = why_podman_cannot_run()
must_run(REASON, "the compose deploy tests")
if REASON:
    pytest.skip(f"deploy tests skipped: {REASON}", allow_module_level=True)

MODEL = "bge_large_zh"
EXPORT_MODEL = "synthetic:bge-small-zh"
RERANKER, RERANK_MODEL = "bge_reranker", "synthetic:bge-reranker-small"
DIM = 512  # bge-small-zh's hidden size
TEXTS = ["部署测试：一段中文文本。", "第二段完全不同的内容"]
TIMINGS: dict[str, float] = {}


def _timed(phase: str, started: float) -> None:
    TIMINGS[phase] = round(time.monotonic() - started, 1)


def _keep(report_dir: Path, name: str) -> None:
    """A copy of a report written against the stack, beside the timings (.kit/deploy-test/NAME/): what it measured
    stays readable after the run (the stand-ins' numbers describe the tool, not a GPU)."""
    dest = Path(os.environ.get("DEPLOY_TEST_TIMINGS", Path.cwd() / ".kit" / "deploy-test-timings.txt")).parent
    shutil.copytree(report_dir, dest / "deploy-test" / name, dirs_exist_ok=True)


def _write_timings() -> None:
    path = Path(os.environ.get("DEPLOY_TEST_TIMINGS", Path.cwd() / ".kit" / "deploy-test-timings.txt"))
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{phase}\t{secs} s" for phase, secs in TIMINGS.items()]
    path.write_text("# tests/deploy/test_compose_stack.py: seconds per phase of the last run\n"
                    + "\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def tree() -> str:
    """The tree under test: DEPLOY_TEST_TREE, default HEAD ('worktree': tracked + untracked files on disk), resolved
    once, so that the images and the compose project come from the same tree even if HEAD moves meanwhile."""
    wanted = os.environ.get("DEPLOY_TEST_TREE", "HEAD")
    if wanted == "worktree":
        return wanted
    # a commit when it is one: `git archive` of a commit stamps every file with the commit's time, so an unchanged
    # tree gives byte-identical build contexts and podman's layer cache holds (a bare tree gets the current time)
    commit = run(["git", "rev-parse", "--verify", "-q", f"{wanted}^{{commit}}"], cwd=REPO, check=False)
    if commit.returncode == 0:
        return commit.stdout.strip()
    return run(["git", "rev-parse", f"{wanted}^{{tree}}"], cwd=REPO).stdout.strip()


@pytest.fixture(scope="module")
def checkout(tree: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean copy of the tree under test: the compose project's directory, and the scripts that build the images."""
    directory = tmp_path_factory.mktemp("compose")
    if tree == "worktree":
        files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
        paths = [p for p in files.split("\0") if p and (REPO / p).exists()]
        subprocess.run(["tar", "-C", str(REPO), "-cf", str(directory / "tree.tar"), *paths], check=True)
    else:
        with (directory / "tree.tar").open("wb") as out:
            subprocess.run(["git", "archive", "--format=tar", tree], cwd=REPO, stdout=out, check=True)
    subprocess.run(["tar", "-xf", "tree.tar"], cwd=directory, check=True)
    (directory / "tree.tar").unlink()
    return directory


@pytest.fixture(scope="module")
def images(checkout: Path) -> dict[str, str]:
    """Base + stand-ins when missing, then every repository image from that clean copy, by its own scripts."""
    t0 = time.monotonic()
    run(["bash", str(checkout / "deploy/standins/build.sh")], timeout=1800)
    _timed("base and stand-ins (build.sh)", t0)
    t0 = time.monotonic()
    timings = Path(f"/tmp/bge-deploy-images-{os.getpid()}.txt")
    timings.unlink(missing_ok=True)
    run(["bash", str(checkout / "deploy/build-images.sh"), "--here"], env={**os.environ, "TIMINGS": str(timings)},
        timeout=3600)
    _timed("repository images (build-images.sh)", t0)
    built = {}
    for line in timings.read_text().splitlines():
        image, secs, size = line.split()
        TIMINGS[f"  {image}: {int(size) / 1e6:.0f} MB, built in"] = float(secs)
        built[image] = size
    timings.unlink()
    return built


@pytest.fixture(scope="module")
def project(images: dict[str, str], checkout: Path):
    """The compose project, up: exporter done, Triton healthy, gateway ready. `down -v` at the end, always."""
    directory = checkout
    # a fresh clone, as it comes: model_repository/ holds only .gitkeep, and the test makes nothing
    assert [p.name for p in (directory / "model_repository").iterdir()] == [".gitkeep"]
    service = ApiService(f"bge-deploy-{os.getpid()}-{directory.name}")
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    http_port, grpc_port, metrics_port, gateway_port = free_ports(4)
    proj = Project(directory, service.docker_host,
                   ports={"TRITON_HTTP_PORT": http_port, "TRITON_GRPC_PORT": grpc_port,
                          "TRITON_METRICS_PORT": metrics_port, "GATEWAY_PORT": gateway_port},
                   extra_env={"EXPORT_MODEL": EXPORT_MODEL, "EXPORT_PRECISION": "fp32", "RERANK_MODEL": RERANK_MODEL,
                              "STANDIN_NOFILE": str(min(nofile, 20000) if nofile > 0 else 20000),
                              "STANDIN_MEMLOCK": str(memlock if memlock > 0 else 8388608)})
    health = HealthDriver(proj.name)
    health.start()
    try:
        t0 = time.monotonic()
        proj.compose("up", "-d", "--no-build", timeout=1800)
        _timed("compose up -d (export, cpu variant, triton healthy)", t0)
        wait_until(lambda: http("GET", proj.gateway_url("/ready"))[0] == 200, "gateway ready", 300)
        _timed("compose up until the gateway is ready", t0)
        yield proj
    finally:
        try:
            proj.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
        finally:
            health.stop()
            service.stop()
            _write_timings()


def _triton_embed(proj: Project, texts: list[str]) -> np.ndarray:
    status, body = http("POST", proj.triton_url(f"/v2/models/{MODEL}/infer"), {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts), 1], "data": texts}],
        "outputs": [{"name": "embedding"}]})
    assert status == 200, body
    out = body["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def _repository(proj: Project) -> Path:
    """The model repository: ./model_repository of the compose directory."""
    return proj.directory / "model_repository"


def _onnx_sha(proj: Project) -> str:
    return hashlib.sha256((_repository(proj) / f"{MODEL}_onnx/1/model.onnx").read_bytes()).hexdigest()


def test_exporter_exported_a_validated_cpu_model(project: Project) -> None:
    assert project.exit_code("exporter") == 0
    logs = project.logs("exporter")
    assert f"exporting {EXPORT_MODEL} (fp32)" in logs, logs[-2000:]
    repo = _repository(project)
    report = json.loads((repo / f"{MODEL}_onnx/1/export_report.json").read_text())
    assert report["fidelity"]["passed"] is True and report["precision"] == "fp32" and report["model"] == EXPORT_MODEL
    assert report["onnx_sha256"] == _onnx_sha(project)
    # docker-compose.cpu.yml: --instance-kind cpu put the encoder the export writes for the GPU on the CPU
    config = (repo / f"{MODEL}_onnx/config.pbtxt").read_text()
    assert "KIND_CPU" in config and "KIND_GPU" not in config and 'backend: "onnxruntime"' in config


def test_triton_serves_the_swapped_encoder_over_http(project: Project) -> None:
    status, cfg = http("GET", project.triton_url(f"/v2/models/{MODEL}_onnx/config"))
    assert status == 200 and cfg["backend"] == "python", cfg  # the stand-in's swap (compose.standin.yml)
    assert http("GET", project.triton_url("/v2/health/ready"))[0] == 200
    vectors = _triton_embed(project, TEXTS)
    assert vectors.shape == (2, DIM)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert float(vectors[0] @ vectors[1]) < 0.999  # two texts, two vectors
    np.testing.assert_allclose(_triton_embed(project, TEXTS[:1])[0], vectors[0], atol=1e-5)  # batch == single


def test_triton_is_healthy_only_when_the_reference_vectors_verify(project: Project) -> None:
    """The compose healthcheck is deploy/verify-ready.sh: healthy means the served model reproduced its export's
    reference vectors; the same check against a spoiled reference fails and names the cause."""
    from bge_triton.verify.standalone import decode_vector, encode_vector

    cid = project.container("triton", running_only=True)
    assert run(["podman", "inspect", "--format", "{{.State.Health.Status}}", cid]).stdout.strip() == "healthy"
    repo = _repository(project)
    doc = json.loads((repo / f"{MODEL}_onnx/1/reference.json").read_text())
    doc["probes"][0]["vector"] = encode_vector(-decode_vector(doc["probes"][0]["vector"]))
    spoiled = repo / "spoiled-reference.json"
    spoiled.write_text(json.dumps(doc))
    try:
        def check(*env: str) -> subprocess.CompletedProcess[str]:
            flags = [a for e in ("VERIFY_STATE_DIR=/tmp/verify-spoiled", "VERIFY_LOG=", *env) for a in ("-e", e)]
            return run(["podman", "exec", *flags, cid, "sh", "/opt/bge-triton/verify-ready.sh"], check=False)

        good = check()
        assert good.returncode == 0, good.stdout + good.stderr
        bad = check("VERIFY_REFERENCE=/models/spoiled-reference.json")
        assert bad.returncode != 0 and doc["probes"][0]["name"] in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    finally:
        spoiled.unlink()


def test_sdk_over_grpc(project: Project) -> None:
    from bge_triton.client import EmbeddingClient

    with EmbeddingClient(f"127.0.0.1:{project.ports['TRITON_GRPC_PORT']}", model=MODEL) as client:
        vectors = np.asarray(client.embed_documents(TEXTS))
    np.testing.assert_allclose(vectors, _triton_embed(project, TEXTS), atol=1e-5)


def test_gateway_needs_its_generated_key(project: Project) -> None:
    key = project.read_file("gateway", "/secrets/gateway_key")
    assert len(key) == 40
    body = {"model": MODEL, "input": TEXTS}
    status, answer = http("POST", project.gateway_url("/v1/embeddings"), body, {"authorization": f"Bearer {key}"})
    assert status == 200, answer
    got = np.asarray([item["embedding"] for item in answer["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, _triton_embed(project, TEXTS), atol=1e-5)
    assert http("POST", project.gateway_url("/v1/embeddings"), body)[0] == 401
    assert http("POST", project.gateway_url("/v1/embeddings"), body, {"authorization": "Bearer wrong-key"})[0] == 401


def test_gateway_reranks_with_the_served_reranker(project: Project) -> None:
    """RERANK_MODEL on: the exporter wrote the reranker, Triton serves it beside the embedder, and the gateway's
    Cohere-shaped /v1/rerank answers with the key, in the order of the scores Triton's endpoint gives."""
    logs = project.logs("exporter")
    assert f"exporting {RERANK_MODEL} (fp32)" in logs and f"{RERANKER}_onnx now runs on KIND_CPU" in logs, logs[-2000:]
    report = json.loads((_repository(project) / f"{RERANKER}_onnx/1/export_report.json").read_text())
    assert report["model"] == RERANK_MODEL and report["fidelity"]["passed"] is True
    assert http("GET", project.triton_url(f"/v2/models/{RERANKER}/ready"))[0] == 200
    # the healthcheck checked the served reranker against its export's reference and logged the verdict
    verdicts = [line for line in project.logs("triton").splitlines()
                if line.startswith("verify-ready: ") and " verified: " in line and " pairs within " in line]
    assert verdicts, project.logs("triton")[-2000:]
    key = project.read_file("gateway", "/secrets/gateway_key")
    docs = ["北京是中国的首都。", "今天天气很好。", "长城位于中国北方。"]
    body = {"model": RERANKER, "query": "中国的首都是哪里？", "documents": docs, "return_documents": True}
    assert http("POST", project.gateway_url("/v1/rerank"), body)[0] == 401
    status, answer = http("POST", project.gateway_url("/v1/rerank"), body, {"authorization": f"Bearer {key}"})
    assert status == 200, answer
    results = answer["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0.0 <= s <= 1.0 for s in scores), results
    assert [r["document"]["text"] for r in results] == [docs[r["index"]] for r in results]


def test_admin_api_refused_without_its_key(project: Project) -> None:
    key = project.read_file("triton", "/secrets/admin_key")
    url = project.triton_url("/v2/repository/index")
    assert http("POST", url, {})[0] == 403
    status, index = http("POST", url, {}, {"triton-admin-key": key})
    assert status == 200 and {m["name"] for m in index} >= {MODEL, f"{MODEL}_onnx"}, index
    assert {m["state"] for m in index if m["name"] in (MODEL, f"{MODEL}_onnx")} == {"READY"}  # --load-model=*
    # explicit model control: the repository API loads (here: reloads) a model, with the key only
    load = project.triton_url(f"/v2/repository/models/{MODEL}/load")
    assert http("POST", load, {})[0] == 403
    status, answer = http("POST", load, {}, {"triton-admin-key": key}, timeout=300)
    assert status == 200, answer
    assert _triton_embed(project, TEXTS).shape == (2, DIM)


def test_restart_triton_keeps_the_keys(project: Project) -> None:
    admin = project.read_file("triton", "/secrets/admin_key")
    gateway = project.read_file("gateway", "/secrets/gateway_key")
    before = _triton_embed(project, TEXTS)
    t0 = time.monotonic()
    project.compose("restart", "triton", timeout=300)
    wait_until(lambda: http("GET", project.triton_url("/v2/health/ready"))[0] == 200, "triton ready again", 300)
    _timed("compose restart triton until ready", t0)
    assert project.read_file("triton", "/secrets/admin_key") == admin
    assert http("POST", project.triton_url("/v2/repository/index"), {}, {"triton-admin-key": admin})[0] == 200
    np.testing.assert_allclose(_triton_embed(project, TEXTS), before, atol=1e-5)
    # the gateway reconnects to the restarted server with the key it kept
    wait_until(lambda: http("GET", project.gateway_url("/ready"))[0] == 200, "gateway ready again", 120)
    status, _ = http("POST", project.gateway_url("/v1/embeddings"), {"model": MODEL, "input": TEXTS[:1]},
                     {"authorization": f"Bearer {gateway}"})
    assert status == 200 and project.read_file("gateway", "/secrets/gateway_key") == gateway


def test_second_up_skips_the_export(project: Project) -> None:
    onnx = _repository(project) / f"{MODEL}_onnx/1/model.onnx"
    sha, mtime = _onnx_sha(project), onnx.stat().st_mtime_ns
    t0 = time.monotonic()
    project.compose("up", "-d", "--no-build", timeout=900)
    _timed("second compose up -d (export skipped)", t0)
    assert project.exit_code("exporter") == 0
    # the verdict lines of `bge-triton export --skip-existing`: this run's two (embedder, reranker) are the last
    verdicts = [line for line in project.logs("exporter").splitlines()
                if line.startswith("exporting ") or line.endswith("skipping the export (--skip-existing)")]
    assert len(verdicts) >= 2 and all("skipping the export" in line for line in verdicts[-2:]), verdicts
    assert f"export of {EXPORT_MODEL} as {MODEL}:" in verdicts[-2]
    assert f"export of {RERANK_MODEL} as {RERANKER}:" in verdicts[-1]
    assert _onnx_sha(project) == sha and onnx.stat().st_mtime_ns == mtime
    wait_until(lambda: http("GET", project.triton_url("/v2/health/ready"))[0] == 200, "triton ready", 300)
    assert _triton_embed(project, TEXTS).shape == (2, DIM)


def _key_as_the_docs_read_it(proj: Project, service: str, path: str) -> str:
    """`docker compose exec -T SERVICE cat PATH`, as docs/examples and the guides tell a user to read a key."""
    return proj.compose("exec", "-T", service, "cat", path, timeout=120).stdout.strip()


@pytest.mark.parametrize(("example", "says"), [
    ("curl.sh", '"object":"embedding"'), ("openai_client.py", f"2 vectors of {DIM} dims"),
    ("sdk.py", f"shape (2, {DIM})"), ("langchain.py", f"2 vectors of {DIM} dims")])
def test_docs_examples_run_as_written(project: Project, example: str, says: str) -> None:
    """docs/examples/* (the README embeds them) against the stack, unchanged: only the addresses come from the
    environment variables the examples read (this stack's free ports), the key as the docs read it."""
    path = project.directory / "docs" / "examples" / example
    env = {**os.environ, "BGE_GATEWAY_URL": project.gateway_url(""),
           "BGE_GATEWAY_KEY": _key_as_the_docs_read_it(project, "gateway", "/secrets/gateway_key"),
           "BGE_TRITON_URL": f"127.0.0.1:{project.ports['TRITON_GRPC_PORT']}"}
    cmd = ["sh", str(path)] if example.endswith(".sh") else [sys.executable, str(path)]
    proc = run(cmd, env=env, cwd=project.directory, timeout=300)
    assert says in proc.stdout.replace(" ", "" if example == "curl.sh" else " "), proc.stdout[-2000:]
    if example == "curl.sh":
        answer = json.loads(proc.stdout.splitlines()[-1])
        assert [len(d["embedding"]) for d in answer["data"]] == [DIM, DIM]


def _kit(*args: str) -> list[str]:
    """`bge-triton ARGS` of the tree under test (the console script is `python -m bge_triton.cli`)."""
    return [sys.executable, "-m", "bge_triton.cli", *args]


def _url_flags(proj: Project, key: str) -> list[str]:
    """The running stack as `--url` (gRPC), its admin key, and its metrics page (on this test's free port)."""
    return ["--url", f"127.0.0.1:{proj.ports['TRITON_GRPC_PORT']}", "--admin-key", key,
            "--metrics-url", f"http://127.0.0.1:{proj.ports['TRITON_METRICS_PORT']}/metrics"]


def _encoder_config(proj: Project) -> dict:
    status, cfg = http("GET", proj.triton_url(f"/v2/models/{MODEL}_onnx/config"))
    assert status == 200, cfg
    return cfg


# the stand-in's encoder is a python model on 2 shared cores: short windows, short texts, low rates
SMALL = ["--quick", "--seq-len", "16"]


def test_tune_applies_its_pick_on_the_running_stack(project: Project, tmp_path: Path) -> None:
    """`bge-triton tune --url ... --admin-key "$KEY" --slo-p99-ms X --apply` against the compose stack, the key read
    the way the docs tell a user; the pick is served afterwards (only batching fields changed), and an embedding
    through the gateway still answers."""
    key = _key_as_the_docs_read_it(project, "triton", "/secrets/admin_key")
    before = _encoder_config(project)
    t0 = time.monotonic()
    proc = run(_kit("tune", *_url_flags(project, key), *SMALL, "--slo-p99-ms", "60000", "--delays-us", "0,3000",
                    "--preferred", "none", "--rates", "4,8", "--tidal-s", "2", "--apply", "--out",
                    str(tmp_path / "tune")), cwd=project.directory, timeout=1200)
    _timed("bge-triton tune --url --apply (2 candidates)", t0)
    assert (tmp_path / "tune" / "tune.md").is_file(), proc.stdout[-2000:]
    _keep(tmp_path / "tune", "tune")
    after = _encoder_config(project)
    delay = int(after["dynamic_batching"].get("max_queue_delay_microseconds", 0))
    assert delay in (0, 3000), after["dynamic_batching"]
    assert {k: v for k, v in after.items() if k != "dynamic_batching"} == \
        {k: v for k, v in before.items() if k != "dynamic_batching"}
    gateway = _key_as_the_docs_read_it(project, "gateway", "/secrets/gateway_key")
    status, answer = http("POST", project.gateway_url("/v1/embeddings"), {"model": MODEL, "input": TEXTS},
                          {"authorization": f"Bearer {gateway}"})
    assert status == 200 and len(answer["data"]) == 2, answer


def _text_config(proj: Project) -> dict:
    status, cfg = http("GET", proj.triton_url(f"/v2/models/{MODEL}/config"))
    assert status == 200, cfg
    return cfg


def test_tune_pair_sweeps_both_models_on_the_running_stack_and_leaves_them_as_found(project: Project,
                                                                                    tmp_path: Path) -> None:
    """`bge-triton tune pair --url ... --admin-key "$KEY" --slo-p99-ms X` (no --apply) against the compose stack: the
    encoder's batching and the text endpoint's settings are tried together, the report is written, and both served
    configs are the ones found before; the gateway still answers."""
    key = _key_as_the_docs_read_it(project, "triton", "/secrets/admin_key")
    before = (_encoder_config(project), _text_config(project))
    t0 = time.monotonic()
    proc = run(_kit("tune", "pair", *_url_flags(project, key), *SMALL, "--slo-p99-ms", "60000", "--no-served",
                    "--delays-us", "0,3000", "--preferred", "none", "--max-in-flight", "2", "--rates", "4",
                    "--tidal-s", "0", "--out", str(tmp_path / "pair")), cwd=project.directory, timeout=1200)
    _timed("bge-triton tune pair --url (2 candidates)", t0)
    report = (tmp_path / "pair" / "pair.md").read_text()
    _keep(tmp_path / "pair", "pair")
    assert "max_in_flight" in report, proc.stdout[-2000:]
    assert (_encoder_config(project), _text_config(project)) == before
    gateway = _key_as_the_docs_read_it(project, "gateway", "/secrets/gateway_key")
    status, answer = http("POST", project.gateway_url("/v1/embeddings"), {"model": MODEL, "input": TEXTS},
                          {"authorization": f"Bearer {gateway}"})
    assert status == 200 and len(answer["data"]) == 2, answer


def test_bench_seed_measures_the_running_stack_and_restores_its_config(project: Project, tmp_path: Path) -> None:
    """`bge-triton bench seed --url ... --admin-key ... --quick` against the compose stack: the report is written and
    the served config is the one found before (each scenario was an override, restored)."""
    key = _key_as_the_docs_read_it(project, "triton", "/secrets/admin_key")
    before = _encoder_config(project)
    t0 = time.monotonic()
    proc = run(_kit("bench", "seed", *_url_flags(project, key), *SMALL, "--users", "1,2", "--static-users", "32",
                    "--out", str(tmp_path / "seed")), cwd=project.directory, timeout=1200)
    _timed("bge-triton bench seed --url --quick", t0)
    report = (tmp_path / "seed" / "seed.md").read_text()
    _keep(tmp_path / "seed", "seed")
    assert "static_32" in report and "dynamic_5ms" in report, proc.stdout[-2000:]
    assert _encoder_config(project) == before
    assert http("GET", project.triton_url("/v2/health/ready"))[0] == 200


def test_down_leaves_nothing_of_the_project(project: Project) -> None:
    assert any(project.leftovers().values())  # the project exists before `down`
    t0 = time.monotonic()
    project.compose("down", "-v", "--remove-orphans", timeout=300)
    _timed("compose down -v", t0)
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}

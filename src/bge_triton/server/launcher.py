"""Run a REAL tritonserver (Triton 2.51 from the nvidia-pytriton wheel) on CPU, bound to 127.0.0.1.

Prepares a writable backends dir with the python stub that matches the running interpreter,
renders the CPU variant of the repository, starts the server, waits for /v2/health/ready,
and records pid + ports in a state dir. Stops only the pid it started.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bge_triton.errors import PortInUse, ServerNotReady
from bge_triton.extras import require
from bge_triton.paths import IMPORT_ROOT, STATE_DIR
from bge_triton.server.cpu_variant import CpuVariant, render_cpu_variant

require("server", "bge_triton.server (the local tritonserver)")

DEFAULT_STATE = STATE_DIR / "server"
ADMIN_HEADER = "triton-admin-key"  # the header of the restricted admin API (deploy/triton-entrypoint.sh's default)
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass
class ServerSettings:
    """Everything `server up` needs; built once from flags (or by tests) and passed down."""

    repository: Path = Path("model_repository")
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    state_dir: Path = DEFAULT_STATE
    model_control: str = "none"  # or "explicit" (the tuner loads configs with overrides)
    load_models: tuple[str, ...] = ()  # with explicit control: models to load at start ("*" = all)
    # A key for Triton's restricted model-repository API (load/unload answer 403 without the header
    # ADMIN_HEADER: key), as deploy/triton-entrypoint.sh serves it; None: the API is open (loopback only).
    admin_key: str | None = None
    ready_timeout_s: float = 180.0
    log_verbose: int = 0
    variant: CpuVariant = field(default_factory=CpuVariant)
    extra_args: tuple[str, ...] = ()
    # None: the python stubs see this venv and the repository (today's dev setup). A tuple of pip specs
    # (e.g. numpy + deploy/Dockerfile.server's list): the stubs get a venv of exactly those, as in the image.
    stub_packages: tuple[str, ...] | None = None
    # The ports were picked free from this pool (free_ports): a start that finds one taken after all (another
    # process bound it between the pick and the server's bind) picks new ones and tries again, up to 3 times.
    # None: the ports were given, and a taken one is an error (PortInUse).
    port_pool: range | None = None


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as exc:
        raise ServerNotReady("nvidia-pytriton is not installed: run `make setup` "
                             "(or pip install nvidia-pytriton==0.7.0)") from exc
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise ServerNotReady(f"no tritonserver binary under {root}: reinstall nvidia-pytriton==0.7.0")
    return root


def prepare_backends(cache_dir: Path) -> Path:
    """Copy the wheel's backends dir to a writable cache and add the matching python stub."""
    root = _pytriton_root()
    stub = root / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise ServerNotReady(f"no python backend stub for Python {PY_VERSION} in the wheel (it has {have}): "
                             "use one of those Python versions for the venv")
    dst = cache_dir / f"backends-py{PY_VERSION}"
    target_stub = dst / "python" / "triton_python_backend_stub"
    if not target_stub.is_file():
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(root / "backends", dst)
        shutil.copy2(stub, target_stub)
        target_stub.chmod(0o755)
    return dst


def stub_venv(packages: tuple[str, ...], cache_dir: Path) -> Path:
    """A venv (no system site-packages, no pip) holding exactly `packages` (pip --no-deps), built once per list.

    The embedded Python of the stub finds its prefix through the first `python3` on PATH, so a venv's bin
    dir first on PATH gives the stubs that venv's site-packages and nothing else (stdlib from the base).
    """
    key = hashlib.sha256("\n".join([PY_VERSION, *sorted(packages)]).encode()).hexdigest()[:12]
    venv = cache_dir / f"stub-venv-py{PY_VERSION}-{key}"
    if (venv / "packages.txt").is_file():
        return venv
    tmp = cache_dir / f".{venv.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    steps = [[sys.executable, "-m", "venv", "--without-pip", str(tmp)],
             [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-warn-script-location",
              "--target", sysconfig.get_path("purelib", vars={"base": str(tmp), "platbase": str(tmp)}), *packages]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ServerNotReady(f"could not build the python stubs' environment {list(packages)}: "
                                 f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}\nCheck the specs and that PyPI "
                                 "(or the pip cache) is reachable.")
    (tmp / "packages.txt").write_text("\n".join(packages) + "\n")
    try:
        tmp.rename(venv)  # atomic: a concurrent build of the same list wins or loses as a whole
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return venv


def server_env(stub_env: Path | None = None) -> dict[str, str]:
    """Environment for tritonserver and its python stubs: this venv's packages and libpython.

    With `stub_env` (a venv from stub_venv) the stubs see that venv only: no PYTHONPATH, no user site.
    """
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")
    wheel_libs = str(_pytriton_root().parent.parent / "nvidia_pytriton.libs")  # libcudart etc. for the stub
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, wheel_libs, env.get("LD_LIBRARY_PATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    if stub_env is not None:
        for var in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV"):
            env.pop(var, None)
        env["PYTHONNOUSERSITE"] = "1"
        env["PATH"] = os.pathsep.join([str(stub_env / "bin"), env.get("PATH", "")])  # stub finds this venv
        return env
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], str(IMPORT_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # stub finds the venv
    return env


def build_command(settings: ServerSettings, backends: Path, repo: Path) -> list[str]:
    """The tritonserver command line: explicit ports, loopback only."""
    cmd = [
        str(_pytriton_root() / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        f"--http-port={settings.http_port}", "--http-address=127.0.0.1",
        f"--grpc-port={settings.grpc_port}", "--grpc-address=127.0.0.1",
        f"--metrics-port={settings.metrics_port}", "--metrics-address=127.0.0.1",
        "--allow-cpu-metrics=true", "--allow-gpu-metrics=false",
        f"--model-control-mode={settings.model_control}",
        f"--log-verbose={settings.log_verbose}",
        "--exit-on-error=true", "--strict-readiness=true",
        "--disable-auto-complete-config",  # configs are complete; saves a second stub import per model
        f"--backend-config=python,shm-default-byte-size={4 * 1024 * 1024}",
    ]
    for model in settings.load_models:
        cmd.append(f"--load-model={model}")
    if settings.admin_key:
        cmd += [f"--http-restricted-api=model-repository:{ADMIN_HEADER}={settings.admin_key}",
                f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={settings.admin_key}"]
    cmd.extend(settings.extra_args)
    return cmd


def free_ports(count: int = 3, pool: range = range(18000, 18500), avoid: tuple[int, ...] = ()) -> list[int]:
    """`count` free loopback ports from `pool` (bound then released), for servers the kit starts.

    The scan starts at a random place in the pool, so two processes picking at once (two test runs, a bench beside
    a test suite) rarely pick the same ports; LocalServer checks that its server bound them and picks again if not.
    """
    import random
    import socket

    found: list[int] = []
    start = random.randrange(len(pool)) if len(pool) else 0
    for port in (*pool[start:], *pool[:start]):
        if port in avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise ServerNotReady(f"fewer than {count} free ports in {pool.start}-{pool.stop - 1}: stop old servers")


def _listening(port: int) -> bool:
    """Something accepts TCP connections on 127.0.0.1:port."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def http_ready(port: int) -> bool:
    """True when the tritonserver on 127.0.0.1:port answers /v2/health/ready with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    """Last lines of the server log, for error messages."""
    if not path.exists():
        return "(no log written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def load_errors(path: Path, limit: int = 6) -> str:
    """The model-load failures in the server log, one line each (the cause, without the traceback).

    Triton prints them long before it exits; the log tail only holds its shutdown chatter.
    """
    if not path.exists():
        return ""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if "failed to load '" not in line or ": " not in line:
            continue
        msg = line.split('"', 1)[-1].rstrip('"')
        msg = msg.replace("\\n", "\n").split("\n\nAt:", 1)[0].split("\nAt:", 1)[0].strip()
        if msg not in found:
            found.append(msg)
    return "\n".join(f"  - {m}" for m in found[:limit])


def _failure(path: Path) -> str:
    """What to show when start-up fails: the model-load errors first, then the log tail."""
    errors = load_errors(path)
    head = f"Models that failed to load:\n{errors}\n" if errors else ""
    return f"{head}Log tail ({path}):\n{log_tail(path)}"


class LocalServer:
    """A real tritonserver process; `with LocalServer(settings) as srv:` starts and stops it."""

    def __init__(self, settings: ServerSettings):
        settings.repository = Path(settings.repository).resolve()  # tritonserver runs with cwd=state
        settings.state_dir = Path(settings.state_dir).resolve()
        self.settings = settings
        self.state = settings.state_dir
        self.log_path = self.state / "tritonserver.log"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The running tritonserver's pid (ServerNotReady if this server was not started or was stopped)."""
        if self.proc is None:
            raise ServerNotReady("this LocalServer is not running: call start() (or use it in a `with` block)")
        return self.proc.pid

    @property
    def running(self) -> subprocess.Popen:
        """The tritonserver process (ServerNotReady if it was not started or was stopped)."""
        if self.proc is None:
            raise ServerNotReady("this LocalServer is not running: call start() (or use it in a `with` block)")
        return self.proc

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.settings.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.settings.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.metrics_port}/metrics"

    def start(self) -> LocalServer:
        for attempt in range(3):
            try:
                return self._start_once()
            except PortInUse:
                pool = self.settings.port_pool
                if pool is None or attempt == 2:
                    raise
                taken = (self.settings.http_port, self.settings.grpc_port, self.settings.metrics_port)
                s = self.settings
                s.http_port, s.grpc_port, s.metrics_port = free_ports(3, pool, avoid=taken)
        raise AssertionError("unreachable")

    def _start_once(self) -> LocalServer:
        s = self.settings
        self.state.mkdir(parents=True, exist_ok=True)
        if not Path(s.repository).is_dir():
            raise ServerNotReady(f"model repository {s.repository} does not exist: run `bge-triton export` "
                                 "first")
        backends = prepare_backends(STATE_DIR / "cache")
        stub_env = None if s.stub_packages is None else stub_venv(s.stub_packages, STATE_DIR / "cache")
        rendered = render_cpu_variant(Path(s.repository), self.state / "repository", s.variant)
        cmd = build_command(s, backends, rendered)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(stub_env),
                                     cwd=self.state, start_new_session=True)
        log.close()
        info = {"pid": self.proc.pid, "http_port": s.http_port, "grpc_port": s.grpc_port,
                "metrics_port": s.metrics_port, "repository": str(s.repository), "log": str(self.log_path),
                "started": time.time(), "variant": {k: str(v) for k, v in asdict(s.variant).items()}}
        (self.state / "server.json").write_text(json.dumps(info, indent=2))
        (self.state / "server.pid").write_text(str(self.proc.pid))
        self.wait_ready(s.ready_timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Ready: HTTP's readiness answered, the other two listeners accept, and THIS server's log says it bound all
        three (another process on the same ports would answer the first two); PortInUse if one was taken."""
        s = self.settings
        bound = (f"Started HTTPService at 127.0.0.1:{s.http_port}", f"Started GRPCInferenceService at 127.0.0.1:"
                 f"{s.grpc_port}", f"Started Metrics Service at 127.0.0.1:{s.metrics_port}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            if re.search(r"Socket '[^']*' already in use", log):
                self.stop()
                raise PortInUse(f"a port of this server was taken by another process after it was picked (http "
                                f"{s.http_port}, grpc {s.grpc_port}, metrics {s.metrics_port}).\n"
                                f"{_failure(self.log_path)}")
            if self.proc is not None and self.proc.poll() is not None:
                self._forget()
                raise ServerNotReady(f"tritonserver exited with code {self.proc.returncode} during start-up.\n"
                                     f"{_failure(self.log_path)}")
            # Triton starts its gRPC, HTTP and metrics listeners one after the other (metrics ~40 ms after
            # HTTP here): ready means HTTP's readiness and the other two accepting connections.
            if all(line in log for line in bound) and http_ready(s.http_port) and all(
                    _listening(port) for port in (s.grpc_port, s.metrics_port)):
                return
            time.sleep(0.25)
        self.stop()
        raise ServerNotReady(f"tritonserver not ready after {timeout_s:.0f} s.\n{_failure(self.log_path)}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the pid we started (graceful), SIGKILL after timeout_s."""
        if self.proc is None:
            return
        stop_pid(self.proc.pid, timeout_s, self.proc)
        self.proc = None
        self._forget()

    def _forget(self) -> None:
        for name in ("server.pid",):
            (self.state / name).unlink(missing_ok=True)

    def __enter__(self) -> LocalServer:
        """Start it, unless it runs already (`with harness.start_server(...) as srv:` starts once)."""
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_pid(pid: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> bool:
    """Stop one tritonserver pid: SIGTERM, wait, then SIGKILL. True if it was running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return True
        elif not pid_alive(pid):
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    if proc is not None:
        proc.wait(timeout=10)
    return True


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False

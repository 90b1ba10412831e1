"""Real tritonserver from the nvidia-pytriton wheel on a bare GPU host: find or unpack it, start it, stop it by pid.

The kit's launcher (server.launcher.LocalServer) cannot run there: it imports `pytriton`, whose own
imports (tritonclient.http with gevent, zmq, wrapt, ...) a bare host lacks, and `bge_triton.server`
requires the `server` extra (onnxruntime, psutil). This starter needs only the wheel's files: the
wheel is a zip, unpacked as is (the binary finds its libraries at ../../../nvidia_pytriton.libs); the
python backend is copied into a writable folder with the stub built for the running Python, as the
launcher's prepare_backends does.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from bge_triton.errors import KitError


class BenchError(KitError):
    """The bench cannot run as asked; the message says what is missing and how to fix it."""


def find_triton_root(wheel_dir: Path, work_dir: Path) -> Path:
    """Folder holding pytriton/tritonserver: the installed package, else the wheel unpacked once."""
    spec = importlib.util.find_spec("pytriton")  # does not import pytriton or its dependencies
    if spec and spec.submodule_search_locations:
        pkg = Path(list(spec.submodule_search_locations)[0])
        if (pkg / "tritonserver" / "bin" / "tritonserver").exists():
            return pkg.parent
    wheels = sorted(wheel_dir.glob("nvidia_pytriton-*.whl"))
    if not wheels:
        raise BenchError(
            f"no tritonserver: nvidia-pytriton is not installed and {wheel_dir} holds no "
            "nvidia_pytriton-*.whl; run `bash src/bge_triton/loadtest/gpu/fetch_wheels.sh` on a machine with PyPI "
            "access and carry src/bge_triton/loadtest/gpu/wheels/ to this host")
    dest = work_dir / "site" / wheels[-1].stem
    marker = dest / ".unpacked"
    if not marker.exists():
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheels[-1]) as zf:
            for info in zf.infolist():
                zf.extract(info, dest)
                mode = info.external_attr >> 16
                if mode:
                    os.chmod(dest / info.filename, stat.S_IMODE(mode))
        marker.write_text(str(wheels[-1]))
    return dest


def prepare_backends(triton_root: Path, work_dir: Path) -> Path:
    """Writable backends dir: python backend + the stub matching this interpreter's version."""
    server = triton_root / "pytriton" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise BenchError(f"the pytriton wheel has no python backend stub for Python {version} "
                         f"({stub}); run the bench with Python 3.8-3.13, and make the wheels for it: "
                         f"GPU_PYTHON_VERSION={version} make gpu-wheels (the slim wheel keeps one stub)")
    backends = work_dir / "backends"
    shutil.rmtree(backends, ignore_errors=True)
    shutil.copytree(server / "backends", backends)
    shutil.copy(stub, backends / "python" / "triton_python_backend_stub")
    for exe in (backends / "python" / "triton_python_backend_stub", server / "bin" / "tritonserver"):
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return backends


def server_env(triton_root: Path) -> dict[str, str]:
    """Environment in which the stub's embedded Python sees this interpreter's stdlib and packages."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    libs = [libdir, str(triton_root / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    env["PYTHONPATH"] = ":".join(paths + [env.get("PYTHONPATH", "")]).rstrip(":")
    return env


@dataclass
class TritonProcess:
    """A running tritonserver started by this bench; stopped by its own pid only."""

    proc: subprocess.Popen
    http_url: str
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(triton_root: Path, backends: Path, repository: Path, log_path: Path,
                 host: str, http_port: int, metrics_port: int, ready_timeout: float) -> TritonProcess:
    """Start tritonserver (HTTP + metrics, no gRPC) and wait for /v2/health/ready while it makes progress: the wait
    fails once its log has not grown for ready_timeout seconds (a loaded host loads python stubs slowly)."""
    cmd = [str(triton_root / "pytriton" / "tritonserver" / "bin" / "tritonserver"),
           f"--model-repository={repository}", f"--backend-directory={backends}", "--model-control-mode=none",
           "--strict-readiness=true", "--allow-grpc=false", f"--http-address={host}", f"--http-port={http_port}",
           "--allow-metrics=true", f"--metrics-address={host}", f"--metrics-port={metrics_port}",
           "--exit-on-error=true", "--log-info=true",
           "--disable-auto-complete-config"]  # else the python backend imports model.py twice
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(triton_root))
    server = TritonProcess(proc, f"http://{host}:{http_port}", log_path)
    deadline, logged = time.monotonic() + ready_timeout, 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"tritonserver exited with code {proc.returncode}; log {log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:  # URLError is one: not up yet
            pass
        if (size := log_path.stat().st_size) > logged:  # progress (a model loaded, an instance started): wait on
            deadline, logged = time.monotonic() + ready_timeout, size
        time.sleep(0.5)
    server.stop()
    raise BenchError(f"tritonserver not ready: its log did not move for {ready_timeout:.0f} s (raise --ready-timeout); "
                     f"log {log_path}:\n{server.log_tail()}")

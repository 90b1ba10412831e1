"""Fault scenarios on servers this module starts itself (never any other process), and the process views they stand
on (sockets, /dev/shm, stubs that outlive a killed server; RSS and stub pids: loadtest.stats):

- kill -9 of tritonserver under load: how fast callers get ServerUnavailable, and whether the SAME client objects
  succeed after a restart on the same ports;
- kill -9 of one python backend stub (a child of that server): what Triton answers and how long until it serves;
- broken model files at start: what `server up` says.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import psutil

from bge_triton.client import EmbeddingClient, KitError, RetryPolicy, ServerUnavailable
from bge_triton.loadtest import harness, loadgen
from bge_triton.loadtest.stats import process_tree, stub_pids
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import LocalServer, free_ports, stop_pid

PORT_RANGE = range(18200, 18300)  # the chaos scenarios' own ports (bench: 18100-18199)
COST = CpuVariant(executor="costmodel", cost_a_us=5000.0, cost_b_us=10.0)  # light on the 2 CPUs


async def capacity(call: Callable[[int], Awaitable[object]], seconds: float, users: int, pause_s: float) -> float:
    """Texts per second sustained closed-loop (loadgen.closed_loop) by `users` users, with queue headroom."""
    t = time.monotonic()
    ok = await loadgen.closed_loop(call, users, lambda: time.monotonic() - t >= seconds, pause_s=pause_s)
    return ok / (time.monotonic() - t)


# -- the server's process tree ----------------------------------------------------------------------------------
def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket held by the server process tree."""
    found = []
    for proc in process_tree(pid):
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return sorted(set(found))


def remove_orphan_shm(stubs: dict[int, str]) -> int:
    """Unlink the python-backend regions in /dev/shm named on these stubs' command lines (their server's own, which
    it cannot unlink after a SIGKILL; never another process's); returns how many were left."""
    names = {cmd.split()[2].lstrip("/") for cmd in stubs.values() if len(cmd.split()) > 2}
    left = [p for p in Path("/dev/shm").glob("*triton_python_backend_shm*") if p.name in names]
    for p in left:
        p.unlink(missing_ok=True)
    return len(left)


def kill_orphan_stubs(stubs: dict[int, str]) -> list[str]:
    """SIGKILL the stubs of a killed server (pid -> command line, seen while it ran) that outlived it; a pid that
    exited or now names another process is never touched. Returns the instance names killed."""
    killed = []
    for pid, cmd in stubs.items():
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE or " ".join(proc.cmdline()) != cmd:
                continue
        except psutil.NoSuchProcess:
            continue
        words = cmd.split()  # stub MODEL_PY SHM_REGION SIZE GROWTH PARENT_PID LIB IPC_KEY INSTANCE ...
        killed.append(words[8] if len(words) > 8 else words[1])
        os.kill(pid, signal.SIGKILL)
    return killed


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> float | None:
    """Seconds until predicate() is true, or None after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(step_s)
    return None


def _model_ready(http_port: int, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{model}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# -- kill -9 of the server under load -------------------------------------------------------------------------------
def _every_worker(log: list[tuple[float, int, str]], since: float, ok: bool, threads: int) -> Callable[[], bool]:
    return lambda: {w for t, w, o in list(log) if t > since and (o == "ok") == ok} >= set(range(threads))


def kill9_under_load(repository: Path, state_dir: Path, model: str = "minilm", threads: int = 3,
                     protocol: str = "grpc") -> dict:
    """SIGKILL our tritonserver while callers are busy; restart it on the same ports; reuse the clients."""
    settings = harness.server_settings(repository, state_dir, COST, port_range=PORT_RANGE)
    srv = LocalServer(settings).start()
    url = srv.grpc_url if protocol == "grpc" else srv.http_url
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2, total_s=2.0)
    clients = [EmbeddingClient(url, model=model, protocol=protocol, timeout_s=5.0, retry=retry).connect()
               for _ in range(threads)]  # long-lived: the same objects before the kill and after the restart
    log: list[tuple[float, int, str]] = []  # (time, worker, outcome)
    odd: list[str] = []  # messages of errors that are not ServerUnavailable
    stop = threading.Event()

    def record(k: float, done: float, kind: str, error: BaseException | None) -> None:
        log.append((done, int(k), kind))
        if error is not None and not isinstance(error, ServerUnavailable) and len(odd) < 5:
            odd.append(str(error)[:300])

    def call(k: int) -> Awaitable[object]:
        return asyncio.to_thread(clients[k].embed_documents, ["今天天气很好 hello"])

    loop = threading.Thread(target=lambda: asyncio.run(loadgen.closed_loop(call, threads, stop.is_set, record, 0.05)))
    loop.start()
    out: dict = {"protocol": protocol, "threads": threads}
    try:
        wait_until(_every_worker(log, 0.0, True, threads), 60)
        time.sleep(1.0)
        stubs = stub_pids(srv.pid)
        out["ok_before_kill"] = sum(1 for _, _, o in log if o == "ok")
        killed_at = time.monotonic()
        os.kill(srv.pid, signal.SIGKILL)  # the server this function started, by its pid
        srv.running.wait(timeout=10)
        srv.proc = None
        out["all_workers_errored"] = wait_until(_every_worker(log, killed_at, False, threads), 120) is not None
        errs: dict[int, tuple[float, str]] = {}
        for t, w, o in list(log):  # each worker's first error after the kill, and its kind
            if t > killed_at and o != "ok" and w not in errs:
                errs[w] = (t - killed_at, o)
        out["error_kinds_after_kill"] = dict(Counter(o for _, o in errs.values()))
        out["max_time_to_error_s"] = max((d for d, _ in errs.values()), default=None)
        out["stubs_exited_after_kill_s"] = wait_until(lambda: not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in stubs), 15)
        out["stubs_outliving_server"] = kill_orphan_stubs(stubs)  # our server's children only
        out["shm_regions_left"] = remove_orphan_shm(stubs)
        restart_t = time.monotonic()
        srv = LocalServer(settings).start()  # same ports, same state dir
        ready_at = time.monotonic()
        out["restart_s"] = ready_at - restart_t
        back = wait_until(_every_worker(log, ready_at, True, threads), 120)  # a safety net, not a target
        out["same_clients_ok_after_restart_s"] = back  # from ready to every old client succeeding
        # recovery once a restart is issued; the wait for stubs to exit is reported apart (stubs_exited_after_kill_s)
        out["max_recovery_s"] = None if back is None else out["restart_s"] + back
    finally:
        stop.set()
        loop.join(timeout=60)
        for c in clients:
            c.close()
        out["outcomes"] = dict(Counter(o for _, _, o in log))
        out["requests"] = len(log)
        out["other_error_messages"] = odd
        srv.stop()
    return out


# -- kill -9 of a python stub ---------------------------------------------------------------------------------------
def kill_stub(repository: Path, state_dir: Path, model: str = "minilm", watch_s: float = 20.0) -> dict:
    """SIGKILL the python stub of the encoder (a child of our server) and watch what Triton does."""
    srv = harness.start_server(repository, state_dir, COST, port_range=PORT_RANGE)
    out: dict = {}
    try:
        client = EmbeddingClient(srv.grpc_url, model=model, timeout_s=10.0, retry=RetryPolicy.off()).connect()
        client.embed_documents(["warm"])
        out["listening"] = listening_addresses(srv.pid)
        target = next(p for p, cmd in stub_pids(srv.pid).items() if f"{model}_onnx" in cmd)
        killed_at = time.monotonic()
        os.kill(target, signal.SIGKILL)  # a child of the server we started
        outcomes: list[tuple[str, float, str]] = []
        first_ok = None
        while time.monotonic() - killed_at < watch_s and sum(o == "ok" for o, _, _ in outcomes) < 3:
            t = time.monotonic()
            try:
                client.embed_documents(["after the stub died"])
                outcomes.append(("ok", time.monotonic() - t, ""))
                first_ok = first_ok or time.monotonic() - killed_at
            except KitError as exc:
                outcomes.append((type(exc).__name__, time.monotonic() - t, str(exc)[:300]))
                time.sleep(0.2)
        out["server_alive"] = srv.running.poll() is None
        out["server_ready"] = _model_ready(srv.settings.http_port, model)
        out["encoder_ready"] = _model_ready(srv.settings.http_port, f"{model}_onnx")
        out["errors"] = [(o, round(d, 3), m) for o, d, m in outcomes if o != "ok"]
        out["first_ok_after_kill_s"] = first_ok
        out["new_stub"] = any(p != target for p, c in stub_pids(srv.pid).items() if f"{model}_onnx" in c)
        log = srv.log_path.read_text(errors="replace").splitlines()
        out["log_lines"] = [ln for ln in log if any(w in ln.lower() for w in ("stub", "unhealthy", "not healthy"))][-6:]
        client.close()
    finally:
        srv.stop()
    return out


# -- broken model files at start ------------------------------------------------------------------------------------
def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


BREAKAGES: dict[str, Callable[[Path, str], object]] = {
    "onnx_missing": lambda r, m: (r / f"{m}_onnx" / "1" / "model.onnx").unlink(),
    "onnx_corrupt": lambda r, m: (r / f"{m}_onnx" / "1" / "model.onnx").write_bytes(b"\x00garbage" * 64),
    "onnx_truncated": lambda r, m: _truncate(r / f"{m}_onnx" / "1" / "model.onnx"),
    "tokenizer_missing": lambda r, m: shutil.rmtree(r / m / "1" / "tokenizer"),
    "tokenizer_corrupt": lambda r, m: (r / m / "1" / "tokenizer" / "tokenizer.json").write_text("{not json"),
    "config_corrupt": lambda r, m: (r / m / "config.pbtxt").write_text("name: \"x\"\nmax_batch_sise: 3\n"),
}


def broken_start(repository: Path, work_dir: Path, case: str, model: str = "minilm",
                 ready_timeout_s: float = 90.0) -> dict:
    """`python -m bge_triton.server up` on a copy of the repository with one breakage; returns rc, time, message."""
    repo = work_dir / f"repo_{case}"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(repository, repo, symlinks=False)
    BREAKAGES[case](repo, model)
    state = work_dir / f"state_{case}"
    ports: Iterable[str] = map(str, free_ports(3, PORT_RANGE))
    cmd = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(repo), "--state-dir", str(state),
           "--ready-timeout", str(ready_timeout_s),
           *(a for flag, port in zip(("--http-port", "--grpc-port", "--metrics-port"), ports, strict=True)
             for a in (flag, port))]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ready_timeout_s + 60)
    out = {"case": case, "rc": proc.returncode, "seconds": time.monotonic() - t,
           "stderr": proc.stderr.strip(), "stdout": proc.stdout.strip()}
    pid_file = state / "server.pid"
    if proc.returncode == 0 and pid_file.exists():  # it came up anyway: stop the pid it wrote
        stop_pid(int(pid_file.read_text()))
        pid_file.unlink(missing_ok=True)
    shutil.rmtree(repo, ignore_errors=True)
    return out

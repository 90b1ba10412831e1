"""Fault scenarios on servers this module starts itself (never any other process):

- kill -9 of tritonserver under load: how fast callers get ServerUnavailable, and whether the SAME
  client objects succeed after a restart on the same ports;
- kill -9 of one python backend stub (a child of that server): what Triton answers and how long
  until the model serves again;
- broken model files at start: what `server up` says.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

from bge_triton.client import EmbeddingClient, KitError, RetryPolicy, ServerUnavailable
from bge_triton.errors import ServerNotReady
from bge_triton.loadtest.chaos_common import (
    PORT_RANGE,
    listening_addresses,
    process_tree,
    server_settings,
    stub_pids,
    wait_until,
)
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import LocalServer, free_ports

COST = CpuVariant(executor="costmodel", cost_a_us=5000.0, cost_b_us=10.0)  # light on the 2 CPUs


def _shm_regions() -> set[str]:
    """Python-backend shared-memory regions in /dev/shm (a SIGKILLed server cannot unlink its own)."""
    try:
        return {p.name for p in Path("/dev/shm").iterdir() if "triton_python_backend_shm" in p.name}
    except OSError:
        return set()


@dataclass
class Load:
    """Worker threads that embed in a loop through their own (long-lived) clients and log outcomes."""

    url: str
    model: str
    threads: int = 3
    protocol: str = "grpc"

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.log: list[tuple[float, int, str]] = []  # (time, worker, outcome)
        self.odd: list[str] = []  # messages of errors that are not ServerUnavailable
        self.ready = threading.Barrier(self.threads + 1)
        self.workers = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(self.threads)]

    def _work(self, i: int) -> None:
        # one long-lived client per thread, created in it (an HTTP client belongs to one thread)
        client = EmbeddingClient(self.url, model=self.model, protocol=self.protocol, timeout_s=5.0,
                                 retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2,
                                                   total_s=2.0)).connect()
        self.ready.wait(timeout=60)
        try:
            self._loop(i, client)
        finally:
            client.close()

    def _loop(self, i: int, client: EmbeddingClient) -> None:
        while not self.stop.is_set():
            try:
                client.embed_documents(["今天天气很好 hello"])
                outcome = "ok"
            except ServerUnavailable as exc:
                outcome = type(exc).__name__
            except KitError as exc:
                outcome = f"{type(exc).__name__}"
                if len(self.odd) < 5:
                    self.odd.append(str(exc)[:300])
            self.log.append((time.monotonic(), i, outcome))
            if outcome != "ok":
                time.sleep(0.05)

    def start(self) -> Load:
        for w in self.workers:
            w.start()
        self.ready.wait(timeout=60)
        return self

    def finish(self) -> None:
        self.stop.set()
        for w in self.workers:
            w.join(timeout=30)


def kill9_under_load(repository: Path, state_dir: Path, model: str = "minilm", threads: int = 3,
                     protocol: str = "grpc") -> dict:
    """SIGKILL our tritonserver while callers are busy; restart it on the same ports; reuse the clients."""
    http, grpc, metrics = free_ports(3, PORT_RANGE)
    settings = server_settings(repository, state_dir, COST, ports=(http, grpc, metrics))
    srv = LocalServer(settings).start()
    shm_before = _shm_regions()
    url = srv.grpc_url if protocol == "grpc" else srv.http_url
    load = Load(url, model, threads, protocol).start()
    out: dict = {"protocol": protocol, "threads": threads}
    try:
        time.sleep(1.5)
        pid = srv.pid
        stubs = stub_pids(pid)
        ok_before = sum(1 for _, _, o in load.log if o == "ok")
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # the server this function started, by its pid
        srv.running.wait(timeout=10)
        srv.proc = None
        # each worker's first error after the kill, and its kind
        first_err = wait_until(lambda: all(any(t > killed_at and o != "ok" and w == i for t, w, o in load.log)
                                           for i in range(threads)), 30)
        errs = {}
        for t, w, o in load.log:
            if t > killed_at and o != "ok" and w not in errs:
                errs[w] = (t - killed_at, o)
        out["error_kinds_after_kill"] = dict(Counter(o for _, o in errs.values()))
        out["max_time_to_error_s"] = max((d for d, _ in errs.values()), default=None)
        out["all_workers_errored"] = first_err is not None
        out["ok_before_kill"] = ok_before
        orphans = wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                             for p in stubs), 15)
        out["stubs_exited_after_kill_s"] = orphans
        out["stubs_outliving_server"] = []
        for p, cmd in stubs.items():  # stubs are our server's children: stop any that outlived it
            try:
                proc = psutil.Process(p)
                if proc.status() == "zombie" or " ".join(proc.cmdline()) != cmd:
                    continue  # exited (or the pid now names another process: never touch it)
            except psutil.NoSuchProcess:
                continue
            words = cmd.split()  # stub MODEL_PY SHM_REGION SIZE GROWTH PARENT_PID LIB IPC_KEY INSTANCE ...
            out["stubs_outliving_server"].append(words[8] if len(words) > 8 else words[1])
            os.kill(p, signal.SIGKILL)
        leaked = _shm_regions() - shm_before
        out["shm_regions_left"] = len(leaked)
        restart_t = time.monotonic()
        srv = LocalServer(settings).start()  # same ports, same state dir
        ready_at = time.monotonic()
        out["restart_s"] = ready_at - restart_t
        back = wait_until(lambda: all(any(t > ready_at and o == "ok" and w == i for t, w, o in load.log)
                                      for i in range(threads)), 30)
        out["same_clients_ok_after_restart_s"] = back  # from ready to every old client succeeding
        # recovery once a restart is issued (start to every old client succeeding); the time spent above
        # waiting for stubs to exit is reported apart (stubs_exited_after_kill_s)
        out["max_recovery_s"] = None if back is None else out["restart_s"] + back
        for name in leaked:  # regions of the killed server only (new since it started, not of the new one)
            if name not in _shm_regions() - leaked:
                (Path("/dev/shm") / name).unlink(missing_ok=True)
    finally:
        load.finish()
        out["outcomes"] = dict(Counter(o for _, _, o in load.log))
        out["requests"] = len(load.log)
        out["other_error_messages"] = load.odd
        srv.stop()
    return out


def _model_ready(http_port: int, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{model}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def kill_stub(repository: Path, state_dir: Path, model: str = "minilm", watch_s: float = 20.0) -> dict:
    """SIGKILL the python stub of the encoder (a child of our server) and watch what Triton does."""
    srv = LocalServer(server_settings(repository, state_dir, COST)).start()
    out: dict = {}
    try:
        client = EmbeddingClient(srv.grpc_url, model=model, timeout_s=10.0, retry=RetryPolicy.off()).connect()
        client.embed_documents(["warm"])
        out["listening"] = listening_addresses(srv.pid)
        stubs = stub_pids(srv.pid)
        target = next(p for p, cmd in stubs.items() if f"{model}_onnx" in cmd)
        killed_at = time.monotonic()
        os.kill(target, signal.SIGKILL)  # a child of the server we started
        outcomes = []
        first_ok = None
        while time.monotonic() - killed_at < watch_s:
            t = time.monotonic()
            try:
                client.embed_documents(["after the stub died"])
                outcomes.append(("ok", time.monotonic() - t, ""))
                if first_ok is None:
                    first_ok = time.monotonic() - killed_at
                if sum(o == "ok" for o, _, _ in outcomes) >= 3:
                    break
            except KitError as exc:
                outcomes.append((type(exc).__name__, time.monotonic() - t, str(exc)[:300]))
                time.sleep(0.2)
        out["server_alive"] = srv.running.poll() is None
        out["server_ready"] = _model_ready(srv.settings.http_port, model)
        out["encoder_ready"] = _model_ready(srv.settings.http_port, f"{model}_onnx")
        out["errors"] = [(o, round(d, 3), m) for o, d, m in outcomes if o != "ok"]
        out["first_ok_after_kill_s"] = first_ok
        out["new_stub"] = any(p != target for p, c in stub_pids(srv.pid).items() if f"{model}_onnx" in c)
        log = srv.log_path.read_text(errors="replace")
        out["log_lines"] = [ln for ln in log.splitlines() if "stub" in ln.lower() or "unhealthy" in ln.lower()
                            or "not healthy" in ln.lower()][-6:]
        client.close()
    finally:
        srv.stop()
    return out


# -- broken model files at start ------------------------------------------------------------
def _copy_repo(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=False)
    return dst


BREAKAGES = {
    "onnx_missing": lambda r, m: (r / f"{m}_onnx" / "1" / "model.onnx").unlink(),
    "onnx_corrupt": lambda r, m: (r / f"{m}_onnx" / "1" / "model.onnx").write_bytes(b"\x00garbage" * 64),
    "onnx_truncated": lambda r, m: _truncate(r / f"{m}_onnx" / "1" / "model.onnx"),
    "tokenizer_missing": lambda r, m: shutil.rmtree(r / m / "1" / "tokenizer"),
    "tokenizer_corrupt": lambda r, m: (r / m / "1" / "tokenizer" / "tokenizer.json").write_text("{not json"),
    "config_corrupt": lambda r, m: (r / m / "config.pbtxt").write_text("name: \"x\"\nmax_batch_sise: 3\n"),
}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def broken_start(repository: Path, work_dir: Path, case: str, model: str = "minilm",
                 ready_timeout_s: float = 90.0) -> dict:
    """`python -m bge_triton.server up` on a copy of the repository with one breakage; returns rc, time, message."""
    repo = _copy_repo(repository, work_dir / f"repo_{case}")
    BREAKAGES[case](repo, model)
    http, grpc, metrics = free_ports(3, PORT_RANGE)
    state = work_dir / f"state_{case}"
    cmd = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(repo), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--state-dir", str(state),
           "--ready-timeout", str(ready_timeout_s)]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ready_timeout_s + 60)
    out = {"case": case, "rc": proc.returncode, "seconds": time.monotonic() - t,
           "stderr": proc.stderr.strip(), "stdout": proc.stdout.strip()}
    pid_file = state / "server.pid"
    if proc.returncode == 0 and pid_file.exists():  # it came up anyway: stop the pid it wrote
        from bge_triton.server.launcher import stop_pid

        stop_pid(int(pid_file.read_text()))
        pid_file.unlink(missing_ok=True)
    shutil.rmtree(repo, ignore_errors=True)
    return out


def start_error(repository: Path, state_dir: Path) -> str:
    """The ServerNotReady message of LocalServer.start() on a repository that cannot load."""
    try:
        srv = LocalServer(server_settings(repository, state_dir, CpuVariant(), ready_timeout_s=90.0)).start()
    except KitError as exc:
        return f"{type(exc).__name__}: {exc}"
    srv.stop()
    return ""


__all__ = ["kill9_under_load", "kill_stub", "broken_start", "BREAKAGES", "process_tree", "ServerNotReady"]

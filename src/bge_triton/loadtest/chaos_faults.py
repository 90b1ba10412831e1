"""Overload and fault scenarios on servers this module starts itself (never any other process):

- overload: Poisson load (loadgen.open_loop) at a multiple of the measured capacity against an emulated encoder
  (costmodel executor) through AsyncEmbeddingClient, baseline (0.3x) -> overload -> recovery (0.3x); each request
  has an outer deadline past which it is lost, and a second pass with the RetryPolicy counts the attempts sent;
- kill -9 of tritonserver under load: how fast callers get ServerUnavailable, and whether the SAME client objects
  succeed after a restart on the same ports;
- kill -9 of one python backend stub: what Triton answers and how long until it serves;
- broken model files at start: what `server up` says.
"""
from __future__ import annotations

import asyncio
import contextvars
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import psutil

from bge_triton.client import AsyncEmbeddingClient, EmbeddingClient, RetryPolicy
from bge_triton.errors import KitError, Overloaded, ServerUnavailable
from bge_triton.loadtest import harness, loadgen
from bge_triton.loadtest.stats import percentile, process_tree, stub_pids, tree_rss_mb
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import LocalServer, free_ports, http_ready, stop_pid
from bge_triton.server.repository import Batching

PORT_RANGE = range(18200, 18300)  # the chaos scenarios' own ports (bench: 18100-18199)
COST = CpuVariant(executor="costmodel", cost_a_us=5000.0, cost_b_us=10.0)  # light on the 2 CPUs
TEXT = "hello world"  # [CLS] hello world [SEP]: 4 tokens, padded to 8 -> a fixed cost per text


async def capacity(call: Callable[[int], Awaitable[object]], seconds: float, users: int, pause_s: float) -> float:
    """Texts per second sustained closed-loop (loadgen.closed_loop) by `users` users."""
    t = time.monotonic()
    ok = await loadgen.closed_loop(call, users, lambda: time.monotonic() - t >= seconds, pause_s=pause_s)
    return ok / (time.monotonic() - t)


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
            return bool(r.status == 200)
    except OSError:
        return False


# -- the server's process tree ----------------------------------------------------------------------------------
def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket held by the server process tree."""
    found = []
    for proc in process_tree(pid):
        try:
            found += [(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
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


# -- overload -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OverloadSettings:
    """Knobs of the overload scenario."""

    repository: Path
    state_dir: Path
    model: str = "minilm"
    factor: float = 3.0
    overload_s: float = 60.0
    baseline_s: float = 4.0
    recovery_s: float = 6.0
    low_factor: float = 0.3
    deadline_s: float = 5.0  # the caller's deadline per request (client timeout_s)
    cost_a_us: float = 1000.0
    cost_b_us: float = 2500.0  # 8 padded tokens x 2.5 ms = 20 ms per text: ~50 texts/s on one instance
    max_batch: int = 8
    queue_timeout_ms: int = 500
    max_queue_size: int = 64
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=3, initial_backoff_s=0.05,
                                                                     max_backoff_s=0.5, total_s=5.0))
    seed: int = 0

    def variant(self) -> CpuVariant:
        """Queue policy on both models: a bounded queue and a REJECT timeout."""
        knobs = Batching(max_batch_size=self.max_batch, preferred_batch_sizes=(), max_queue_delay_us=0,
                         max_queue_size=self.max_queue_size, queue_timeout_us=self.queue_timeout_ms * 1000)
        return CpuVariant(executor="costmodel", cost_a_us=self.cost_a_us, cost_b_us=self.cost_b_us,
                          batching={self.model: knobs, f"{self.model}_onnx": knobs},
                          text_params={"sub_batch_max": str(self.max_batch)})

    @property
    def latency_bound_s(self) -> float:
        """What the queue policy allows an ACCEPTED request: both queue timeouts + one batch each + slack."""
        return 2 * self.queue_timeout_ms / 1000 + 2 * (self.cost_a_us + self.cost_b_us * self.max_batch * 8) / 1e6 + 0.5


@dataclass
class Shot:
    phase: str
    sched: float  # seconds since the run began
    latency: float
    outcome: str  # "ok", errors.kind_of(error), or "lost"
    attempts: int = 1


_ATTEMPTS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("attempts")


def _count_attempts(client: AsyncEmbeddingClient) -> None:
    """Wrap the client's transport.infer to count the attempts really sent (retries included) per request, into
    the list each request's task sets in _ATTEMPTS."""
    infer = client._transport.infer

    async def counting(call, timeout_s):
        if (mine := _ATTEMPTS.get(None)) is not None:
            mine[0] += 1
        return await infer(call, timeout_s)

    client._transport.infer = counting


async def _storm(client: AsyncEmbeddingClient, phases: list[tuple[str, float, float]], deadline_s: float,
                 rng: random.Random) -> list[Shot]:
    """Poisson arrivals, phases = [(name, rate_rps, seconds)] back to back; one Shot per request, none left out."""
    t0, shots, attempts = time.monotonic(), list[Shot](), dict[float, list[int]]()  # send time -> [attempts sent]
    ends = [sum(s for _, _, s in phases[:k + 1]) for k in range(len(phases))]

    def now() -> float:
        return time.monotonic() - t0

    async def times() -> AsyncIterator[float]:
        for (_, rate, _), start, end in zip(phases, [0.0, *ends], ends, strict=False):
            async for t in loadgen.poisson(rng, partial(float, rate), now, start, end, yield_when_late=False):
                yield t

    async def call(t: float) -> None:
        _ATTEMPTS.set(attempts.setdefault(t, [0]))
        await client.embed_documents([TEXT], timeout_s=deadline_s)

    def record(t: float, done: float, kind: str, _error: BaseException | None) -> None:
        phase = phases[next(k for k, end in enumerate(ends) if t < end)][0]
        shots.append(Shot(phase, t, done - t, kind, attempts.pop(t, [1])[0]))

    await loadgen.open_loop(call, times(), now, record, deadline_s + 2.0)
    return shots


def recovery_time(shots: list[Shot], drop_at: float, normal_s: float) -> float:
    """Seconds from the load drop until the last abnormal answer (error, or latency above normal_s)."""
    return max((s.sched + s.latency - drop_at for s in shots
                if s.phase == "recovery" and (s.outcome != "ok" or s.latency > normal_s)), default=0.0)


async def _overload(s: OverloadSettings, url: str, pid: int) -> dict:
    rng = random.Random(s.seed)
    async with AsyncEmbeddingClient(url, model=s.model, retry=RetryPolicy.off(), timeout_s=s.deadline_s) as client:
        _count_attempts(client)
        warm = 0
        for _ in range(50):  # the first calls are slow (stub start-up) and may hit the queue timeout
            try:
                await client.embed_documents([TEXT])
                warm += 1
            except Overloaded:
                await asyncio.sleep(0.2)
            if warm >= 5:
                break
        cap = await capacity(lambda _k: client.embed_documents([TEXT]), 3.0, 16, 0.01)
        low, high = s.low_factor * cap, s.factor * cap
        rss_before = tree_rss_mb(pid)
        shots = await _storm(client, [("baseline", low, s.baseline_s), ("overload", high, s.overload_s),
                                      ("recovery", low, s.recovery_s)], s.deadline_s, rng)
    base = [x.latency for x in shots if x.phase == "baseline" and x.outcome == "ok"]
    base_p50 = percentile(base, 50) if base else 0.05
    normal_s = max(3 * base_p50, percentile(base, 99) * 1.5 if base else 0.1, 0.1)
    over = [x for x in shots if x.phase == "overload"]
    accepted = [x.latency for x in over if x.outcome == "ok"]
    rejected = [x.latency for x in over if x.outcome == "Overloaded"]
    # the same storm with retries on: attempts per request must stay bounded by max_attempts
    async with AsyncEmbeddingClient(url, model=s.model, retry=s.retry, timeout_s=s.deadline_s) as client:
        _count_attempts(client)
        retried = await _storm(client, [("retry", high, min(s.overload_s, 10.0))], s.deadline_s, rng)
    return {
        "capacity_rps": cap, "offered_rps": high, "factor": s.factor, "overload_s": s.overload_s,
        "deadline_s": s.deadline_s, "requests": len(shots), "outcomes": dict(Counter(x.outcome for x in shots)),
        "overload_outcomes": dict(Counter(x.outcome for x in over)), "lost": sum(x.outcome == "lost" for x in shots),
        "baseline_p50_s": base_p50, "normal_s": normal_s,
        "accepted_p99_s": percentile(accepted, 99) if accepted else 0.0, "accepted_max_s": max(accepted, default=0.0),
        "latency_bound_s": s.latency_bound_s, "rejected_p99_s": percentile(rejected, 99) if rejected else 0.0,
        "rejected_max_s": max(rejected, default=0.0),
        "recovery_s": recovery_time(shots, s.baseline_s + s.overload_s, normal_s),
        "rss_growth_mb": tree_rss_mb(pid) - rss_before,
        "retry_requests": len(retried), "retry_attempts": sum(x.attempts for x in retried),
        "retry_max_attempts_seen": max((x.attempts for x in retried), default=0),
        "retry_policy_max_attempts": s.retry.max_attempts, "retry_outcomes": dict(Counter(x.outcome for x in retried)),
        "shots": shots,
    }


def run_overload(settings: OverloadSettings) -> dict:
    """Start a costmodel server we own, run the phases, stop it; returns the figures (and every shot)."""
    srv = harness.start_server(settings.repository, settings.state_dir, settings.variant(), port_range=PORT_RANGE)
    try:
        result = asyncio.run(_overload(settings, srv.grpc_url, srv.pid))
        result["server_alive_after"] = srv.running.poll() is None
        result["server_ready_after"] = http_ready(srv.settings.http_port)
        return result
    finally:
        srv.stop()


# -- kill -9 of the server under load -------------------------------------------------------------------------------
def _every_worker(log: list[tuple[float, int, str]], since: float, ok: bool, threads: int) -> Callable[[], bool]:
    return lambda: {w for t, w, o in list(log) if t > since and (o == "ok") == ok} >= set(range(threads))


def kill9_under_load(repository: Path, state_dir: Path, model: str = "minilm", threads: int = 3,
                     protocol: str = "grpc") -> dict:
    """SIGKILL our tritonserver while callers (loadgen.closed_loop) are busy; restart it on the same ports; reuse
    the clients."""
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
        out.update(outcomes=dict(Counter(o for _, _, o in log)), requests=len(log), other_error_messages=odd)
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
        port = srv.settings.http_port
        out.update(server_alive=srv.running.poll() is None, server_ready=_model_ready(port, model),
                   encoder_ready=_model_ready(port, f"{model}_onnx"),
                   errors=[(o, round(d, 3), m) for o, d, m in outcomes if o != "ok"], first_ok_after_kill_s=first_ok,
                   new_stub=any(p != target for p, c in stub_pids(srv.pid).items() if f"{model}_onnx" in c))
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
    "tokenizer_missing": lambda r, m: shutil.rmtree(r / m / "1" / "tokenizer"),
    "config_corrupt": lambda r, m: (r / m / "config.pbtxt").write_text("name: \"x\"\nmax_batch_sise: 3\n"),
    "onnx_truncated": lambda r, m: _truncate(r / f"{m}_onnx" / "1" / "model.onnx"),
    "tokenizer_corrupt": lambda r, m: (r / m / "1" / "tokenizer" / "tokenizer.json").write_text("{not json"),
}


def broken_start(repository: Path, work_dir: Path, case: str, model: str = "minilm",
                 ready_timeout_s: float = 90.0) -> dict:
    """`python -m bge_triton.server up` on a copy of the repository with one breakage; returns rc, time, message."""
    repo, state = work_dir / f"repo_{case}", work_dir / f"state_{case}"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(repository, repo, symlinks=False)
    BREAKAGES[case](repo, model)
    http, grpc, metrics = free_ports(3, PORT_RANGE)
    cmd = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(repo), "--state-dir", str(state),
           "--ready-timeout", str(ready_timeout_s), "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics)]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ready_timeout_s + 60)
    out = {"case": case, "rc": proc.returncode, "seconds": time.monotonic() - t,
           "stderr": proc.stderr.strip(), "stdout": proc.stdout.strip()}
    if proc.returncode == 0 and (pid_file := state / "server.pid").exists():  # it came up anyway: stop its pid
        stop_pid(int(pid_file.read_text()))
        pid_file.unlink(missing_ok=True)
    shutil.rmtree(repo, ignore_errors=True)
    return out

"""Overload and faults on servers this module starts itself (never any other process): Poisson overload of an
emulated encoder (with and without retries), kill -9 of tritonserver under load and of one python stub, broken model
files at `server up`."""
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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import psutil

from bge_triton.client import AsyncEmbeddingClient, EmbeddingClient, RetryPolicy
from bge_triton.client.transport import HttpSync
from bge_triton.errors import KitError, ServerUnavailable
from bge_triton.loadtest import harness, loadgen
from bge_triton.loadtest.stats import percentile, process_tree, stub_pids, tree_rss_mb
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import LocalServer, free_ports, http_ready, stop_pid
from bge_triton.server.repository import Batching

PORT_RANGE = range(18200, 18300)  # the chaos scenarios' own ports (bench: 18100-18199)
COST = CpuVariant(executor="costmodel", cost_a_us=5000.0, cost_b_us=10.0)  # light on the 2 CPUs
TEXT = "hello world"  # [CLS] hello world [SEP]: 4 tokens, padded to 8 -> a fixed cost per text
_ATTEMPTS = contextvars.ContextVar[list[int]]("attempts")  # each overload request's task: the attempts really sent


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


def remove_orphan_shm(stubs: dict[int, str]) -> int:
    """Unlink the /dev/shm regions named on these (killed server's) stubs' command lines; returns how many."""
    names = {cmd.split()[2].lstrip("/") for cmd in stubs.values() if len(cmd.split()) > 2}
    left = [p for p in Path("/dev/shm").glob("*triton_python_backend_shm*") if p.name in names]
    for p in left:
        p.unlink(missing_ok=True)
    return len(left)


def kill_orphan_stubs(stubs: dict[int, str]) -> list[str]:
    """SIGKILL the stubs (pid -> command line) that outlived their killed server, never a pid now naming another
    process; returns the instance names killed."""
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
FACTOR, LOW, DEADLINE_S = 3.0, 0.3, 5.0  # the storm and its calm phases (x the capacity); each request's deadline
RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.5, total_s=5.0)  # the second storm's
QUEUE = Batching(max_batch_size=8, preferred_batch_sizes=(), max_queue_delay_us=0, max_queue_size=64,
                 queue_timeout_us=500_000)  # on both models: a bounded queue and a REJECT timeout
COST_US = (1000.0, 2500.0)  # costmodel a, b: 8 padded tokens x 2.5 ms = 20 ms per text, ~50 texts/s on one instance
# what the queue policy allows an ACCEPTED request: both queue timeouts + one batch each + slack
BOUND_S = 2 * 0.5 + 2 * (COST_US[0] + COST_US[1] * 8 * 8) / 1e6 + 0.5


class Shot(NamedTuple):
    phase: str
    sched: float  # seconds since the run began
    latency: float
    outcome: str  # "ok", errors.kind_of(error), or "lost"
    attempts: int = 1


async def _storm(client: AsyncEmbeddingClient, phases: list[tuple[str, float, float]], rng: random.Random
                 ) -> list[Shot]:
    """Poisson arrivals, phases = [(name, rate_rps, seconds)] back to back; one Shot per request, none left out."""
    t0, shots, attempts = time.monotonic(), list[Shot](), dict[float, list[int]]()  # send time -> [attempts sent]
    ends = [t0 + sum(s for _, _, s in phases[:k + 1]) for k in range(len(phases))]
    infer = client._transport.infer

    async def counting(call, timeout_s):
        _ATTEMPTS.get([0])[0] += 1
        return await infer(call, timeout_s)

    async def times() -> AsyncIterator[float]:
        for (_, rate, _), start, end in zip(phases, [t0, *ends], ends, strict=False):
            async for t in loadgen.poisson(rng, partial(float, rate), time.monotonic, start, end, False):
                yield t

    async def call(t: float) -> None:
        _ATTEMPTS.set(attempts.setdefault(t, [0]))
        await client.embed_documents([TEXT], timeout_s=DEADLINE_S)

    def record(t: float, done: float, kind: str, _error: BaseException | None) -> None:
        phase = phases[next(k for k, end in enumerate(ends) if t < end)][0]
        shots.append(Shot(phase, t - t0, done - t, kind, attempts.pop(t, [1])[0]))

    client._transport.infer = counting
    await loadgen.open_loop(call, times(), time.monotonic, record, DEADLINE_S + 2.0)
    return shots


def recovery_time(shots: list[Shot], drop_at: float, normal_s: float) -> float:
    """Seconds from the load drop until the last abnormal answer (error, or latency above normal_s)."""
    return max((s.sched + s.latency - drop_at for s in shots
                if s.phase == "recovery" and (s.outcome != "ok" or s.latency > normal_s)), default=0.0)


async def _overload(url: str, pid: int, model: str, seconds: tuple[float, float, float]) -> dict:
    rng, warm = random.Random(0), Counter[str]()
    async with AsyncEmbeddingClient(url, model=model, retry=RetryPolicy.off(), timeout_s=DEADLINE_S) as client:
        # the first calls are slow (stub start-up) and may hit the queue timeout
        await loadgen.closed_loop(lambda _k: client.embed_documents([TEXT]), 1,
                                  lambda: warm["ok"] >= 5 or warm.total() >= 50, lambda *r: warm.update([r[2]]), 0.2)
        cap = await capacity(lambda _k: client.embed_documents([TEXT]), 3.0, 16, 0.01)
        rss_before = tree_rss_mb(pid)
        rates = (LOW * cap, FACTOR * cap, LOW * cap)
        shots = await _storm(client, list(zip(("baseline", "overload", "recovery"), rates, seconds, strict=True)), rng)
    base = [x.latency for x in shots if x.phase == "baseline" and x.outcome == "ok"] or [0.05]
    normal_s = max(3 * percentile(base, 50), percentile(base, 99) * 1.5, 0.1)
    over = [x for x in shots if x.phase == "overload"]
    accepted = [x.latency for x in over if x.outcome == "ok"] or [0.0]
    rejected = [x.latency for x in over if x.outcome == "Overloaded"] or [0.0]
    # the same storm with retries on: attempts per request must stay bounded by max_attempts
    async with AsyncEmbeddingClient(url, model=model, retry=RETRY, timeout_s=DEADLINE_S) as client:
        retried = await _storm(client, [("retry", FACTOR * cap, min(seconds[1], 10.0))], rng)
    return {
        "capacity_rps": cap, "offered_rps": FACTOR * cap, "factor": FACTOR, "overload_s": seconds[1],
        "deadline_s": DEADLINE_S, "requests": len(shots), "outcomes": dict(Counter(x.outcome for x in shots)),
        "overload_outcomes": dict(Counter(x.outcome for x in over)), "lost": sum(x.outcome == "lost" for x in shots),
        "baseline_p50_s": percentile(base, 50), "normal_s": normal_s, "accepted_p99_s": percentile(accepted, 99),
        "accepted_max_s": max(accepted), "latency_bound_s": BOUND_S, "rejected_p99_s": percentile(rejected, 99),
        "rejected_max_s": max(rejected), "recovery_s": recovery_time(shots, seconds[0] + seconds[1], normal_s),
        "rss_growth_mb": tree_rss_mb(pid) - rss_before,
        "retry_requests": len(retried), "retry_attempts": sum(x.attempts for x in retried),
        "retry_max_attempts_seen": max((x.attempts for x in retried), default=0),
        "retry_policy_max_attempts": RETRY.max_attempts, "retry_outcomes": dict(Counter(x.outcome for x in retried)),
        "shots": shots,
    }


def run_overload(repository: Path, state_dir: Path, model: str = "minilm", overload_s: float = 60.0,
                 baseline_s: float = 4.0, recovery_s: float = 6.0) -> dict:
    """Start a costmodel server we own, run the phases, stop it; returns the figures (and every shot)."""
    variant = CpuVariant(executor="costmodel", cost_a_us=COST_US[0], cost_b_us=COST_US[1],
                         batching={model: QUEUE, f"{model}_onnx": QUEUE}, text_params={"sub_batch_max": "8"})
    srv = harness.start_server(repository, state_dir, variant, port_range=PORT_RANGE)
    try:
        result = asyncio.run(_overload(srv.grpc_url, srv.pid, model, (baseline_s, overload_s, recovery_s)))
        return {**result, "server_alive_after": srv.running.poll() is None,
                "server_ready_after": http_ready(srv.settings.http_port)}
    finally:
        srv.stop()


# -- kill -9 --------------------------------------------------------------------------------------------------------
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

    def every_worker(since: float, ok: bool, timeout_s: float) -> float | None:
        workers = set(range(threads))
        return wait_until(lambda: {w for t, w, o in list(log) if t > since and (o == "ok") == ok} >= workers, timeout_s)

    def call(k: int) -> Awaitable[object]:
        return asyncio.to_thread(clients[k].embed_documents, ["今天天气很好 hello"])

    loop = threading.Thread(target=lambda: asyncio.run(loadgen.closed_loop(call, threads, stop.is_set, record, 0.05)))
    loop.start()
    out: dict = {"protocol": protocol, "threads": threads}
    try:
        every_worker(0.0, True, 60)
        time.sleep(1.0)
        stubs = stub_pids(srv.pid)
        out["ok_before_kill"] = sum(1 for _, _, o in log if o == "ok")
        killed_at = time.monotonic()
        os.kill(srv.pid, signal.SIGKILL)  # the server this function started, by its pid
        srv.running.wait(timeout=10)
        srv.proc = None
        out["all_workers_errored"] = every_worker(killed_at, False, 120) is not None
        # each worker's first error after the kill, and its kind
        errs = {w: (t - killed_at, o) for t, w, o in reversed(log) if t > killed_at and o != "ok"}
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
        back = every_worker(ready_at, True, 120)  # a safety net, not a target
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


def kill_stub(repository: Path, state_dir: Path, model: str = "minilm", watch_s: float = 20.0) -> dict:
    """SIGKILL the python stub of the encoder (a child of our server) and watch what Triton does."""
    srv = harness.start_server(repository, state_dir, COST, port_range=PORT_RANGE)
    try:
        client = EmbeddingClient(srv.grpc_url, model=model, timeout_s=10.0, retry=RetryPolicy.off()).connect()
        client.embed_documents(["warm"])
        out: dict = {"listening": sorted({(c.laddr.ip, c.laddr.port) for p in process_tree(srv.pid)
                                          for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})}
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
        http = HttpSync(srv.http_url)
        out.update(server_alive=srv.running.poll() is None, server_ready=http.ready(model, 2.0),
                   encoder_ready=http.ready(f"{model}_onnx", 2.0),
                   errors=[(o, round(d, 3), m) for o, d, m in outcomes if o != "ok"], first_ok_after_kill_s=first_ok,
                   new_stub=any(p != target for p, c in stub_pids(srv.pid).items() if f"{model}_onnx" in c))
        log = srv.log_path.read_text(errors="replace").splitlines()
        out["log_lines"] = [ln for ln in log if any(w in ln.lower() for w in ("stub", "unhealthy", "not healthy"))][-6:]
        client.close()
        http.close()
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
    ports = [f"--{k}-port={p}" for k, p in zip(("http", "grpc", "metrics"), free_ports(3, PORT_RANGE), strict=True)]
    cmd = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(repo), "--state-dir", str(state),
           "--ready-timeout", str(ready_timeout_s), *ports]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ready_timeout_s + 60)
    out = {"case": case, "rc": proc.returncode, "seconds": time.monotonic() - t, "stderr": proc.stderr.strip()}
    if proc.returncode == 0 and (pid_file := state / "server.pid").exists():  # it came up anyway: stop its pid
        stop_pid(int(pid_file.read_text()))
        pid_file.unlink(missing_ok=True)
    shutil.rmtree(repo, ignore_errors=True)
    return out

"""`bge-triton chaos [--quick] [--out reports/chaos]`: bad input (sent below the SDK client's own checks), 3x overload
of an emulated (costmodel) encoder, kill -9 of tritonserver under load and of one python stub, broken model files at
`server up`; on tritonservers it starts, kills and restarts itself, so it takes no --url. Writes chaos.md, chaos.csv
and chaos_overload.png.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import math
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import psutil

from bge_triton import flags
from bge_triton.client import AsyncEmbeddingClient, ClientSettings, EmbeddingClient, RetryPolicy
from bge_triton.client.core import InferCall
from bge_triton.client.transport import HttpSync, make_async_transport
from bge_triton.errors import KitError, ServerUnavailable, kind_of
from bge_triton.extras import require
from bge_triton.loadtest import faults, harness, loadgen, report
from bge_triton.loadtest.bad_input import flood, run_catalogue
from bge_triton.loadtest.chaos_report import summary, write_report
from bge_triton.loadtest.faults import PORT_RANGE, capacity, wait_until
from bge_triton.loadtest.stats import percentile, process_tree, stub_pids, tree_rss_mb
from bge_triton.repository import Batching
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import http_ready

require("loadtest", "bge-triton chaos")

COMMAND = "bge-triton chaos"
Inputs = list[tuple[str, str, np.ndarray]]  # (name, datatype, array) per input
COST = CpuVariant(executor="costmodel", cost_a_us=5000.0, cost_b_us=10.0)  # the fault scenarios': light on 2 CPUs
TEXT = "hello world"  # [CLS] hello world [SEP]: 4 tokens, padded to 8 -> a fixed cost per text
URL_HELP = ("not accepted: chaos kills tritonservers and python stubs (kill -9), restarts them and starts servers over "
            "broken model files, so it runs only on servers it starts itself; leave out --url (to measure a running "
            "server, give --url to the bench scenarios that take one, e.g. `bge-triton bench seed --url URL`)")
_ATTEMPTS = contextvars.ContextVar[list[int]]("attempts")  # each overload request's task: the attempts really sent


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
    attempts: int = 1  # infer attempts that reached the transport (0: lost before the first was sent)


class Attempts:
    """The client's transport (its public `transport=` seam) around the SDK's own: counts every infer attempt that
    reaches the wire, in all and per request (the request's task holds its counter in _ATTEMPTS)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.total = inner, 0

    async def infer(self, call: InferCall, timeout_s: float) -> Any:
        self.total += 1
        _ATTEMPTS.get([0])[0] += 1
        return await self.inner.infer(call, timeout_s)

    def __getattr__(self, name: str) -> Any:  # model_config, ready, close: the SDK's own
        return getattr(self.inner, name)


def storm_client(url: str, model: str, retry: RetryPolicy) -> tuple[AsyncEmbeddingClient, Attempts]:
    """An SDK client whose infer attempts are counted (Attempts, through the client's `transport=`)."""
    settings = ClientSettings(url=url, model=model, retry=retry, timeout_s=DEADLINE_S)
    wire = Attempts(make_async_transport(settings))
    return AsyncEmbeddingClient(settings=settings, transport=wire), wire


async def _storm(client: AsyncEmbeddingClient, base_rps: float, seconds: float, rng: random.Random,
                 spike: tuple[float, float, float] | None = None) -> tuple[int, list[Shot]]:
    """Poisson arrivals at base_rps for `seconds`, with an overload spike (at_s, factor, length_s: faults.Rate.spike);
    returns the count sent (loadgen.open_loop's) and one Shot per request answered or lost."""
    t0, shots, attempts, rate = time.monotonic(), list[Shot](), dict[float, list[int]](), faults.Rate(base_rps)
    at, factor, length = spike or (math.inf, 1.0, 0.0)

    def phase(sched: float) -> str:
        return "retry" if spike is None else "baseline" if sched < at else "overload" if sched < at + length \
            else "recovery"

    async def spiking() -> None:
        await asyncio.sleep(at)
        await rate.spike(factor, length)

    async def call(t: float) -> None:
        _ATTEMPTS.set(attempts.setdefault(t, [0]))
        await client.embed_documents([TEXT], timeout_s=DEADLINE_S)

    def record(t: float, done: float, kind: str, _error: BaseException | None) -> None:
        shots.append(Shot(phase(t - t0), t - t0, done - t, kind, attempts.pop(t, [0])[0]))

    spiker = asyncio.ensure_future(spiking()) if spike else None
    times = loadgen.poisson(rng, rate, time.monotonic, t0, t0 + seconds, False)
    sent = await loadgen.open_loop(call, times, time.monotonic, record, DEADLINE_S + 2.0)
    if spiker is not None:
        spiker.cancel()
    return sent, shots


def run_overload(repository: Path, state_dir: Path, model: str = "minilm", overload_s: float = 60.0,
                 baseline_s: float = 4.0, recovery_s: float = 8.0) -> dict:
    """Start a costmodel server we own, offer LOW x its capacity with an overload spike to FACTOR x (faults.Rate),
    stop it; returns the figures, the spike's faults.Outcome and every shot."""
    variant = CpuVariant(executor="costmodel", cost_a_us=COST_US[0], cost_b_us=COST_US[1],
                         batching={model: QUEUE, f"{model}_onnx": QUEUE}, text_params={"sub_batch_max": "8"})
    srv = harness.start_server(repository, state_dir, variant, port_range=PORT_RANGE)
    total_s = baseline_s + overload_s + recovery_s

    async def storms() -> tuple[float, float, tuple[int, list[Shot], int], tuple[int, list[Shot], int]]:
        warm, rng = Counter[str](), random.Random(0)
        c, wire = storm_client(srv.grpc_url, model, RetryPolicy.off())
        async with c:
            # the first calls are slow (stub start-up) and may hit the queue timeout
            await loadgen.closed_loop(lambda _k: c.embed_documents([TEXT]), 1, lambda: warm["ok"] >= 5
                                      or warm.total() >= 50, lambda *r: warm.update([r[2]]), 0.2)
            cap = await capacity(lambda _k: c.embed_documents([TEXT]), 3.0, 16, 0.01)
            rss, before = tree_rss_mb(srv.pid), wire.total
            sent, shots = await _storm(c, LOW * cap, total_s, rng, (baseline_s, FACTOR / LOW, overload_s))
            first = (sent, shots, wire.total - before)
        # the same storm with retries on: attempts per request must stay bounded by max_attempts
        c, wire = storm_client(srv.grpc_url, model, RETRY)
        async with c:
            before = wire.total
            sent, shots = await _storm(c, FACTOR * cap, min(overload_s, 10.0), rng)
            return cap, rss, first, (sent, shots, wire.total - before)

    try:
        cap, rss_before, (sent, shots, wire), (retry_sent, retried, retry_wire) = asyncio.run(storms())
        rss_growth = tree_rss_mb(srv.pid) - rss_before
        alive, ready = srv.running.poll() is None, http_ready(srv.settings.http_port)
    finally:
        srv.stop()
    # the spike's outcome, judged as every fault is (faults.judge): latency from the scheduled send time
    calm = [faults.Shot(x.sched, x.sched + x.latency, x.outcome) for x in shots]
    threshold = faults.calm_p99(calm, baseline_s)[1]
    width = max(1.0, 10.0 / (LOW * cap))  # ten requests a window at the calm rate
    spike = faults.judge(faults.Outcome(faults.OVERLOAD_SPIKE, baseline_s, overload_s), calm, threshold, width,
                         total_s)
    over = [x for x in shots if x.phase == "overload"]
    accepted = [x.latency for x in over if x.outcome == "ok"] or [0.0]
    rejected = [x.latency for x in over if x.outcome == "Overloaded"] or [0.0]
    answered = [x for x in shots if x.outcome != "lost"]
    return {
        "capacity_rps": cap, "offered_rps": FACTOR * cap, "factor": FACTOR, "overload_s": overload_s,
        "deadline_s": DEADLINE_S, "requests": sent, "answered": len(answered), "wire_attempts": wire,
        "outcomes": dict(Counter(x.outcome for x in shots)),
        "overload_outcomes": dict(Counter(x.outcome for x in over)), "lost": sent - len(answered),
        "normal_s": threshold, "accepted_p99_s": percentile(accepted, 99),
        "accepted_max_s": max(accepted), "latency_bound_s": BOUND_S, "rejected_p99_s": percentile(rejected, 99),
        "rejected_max_s": max(rejected), "recovery_s": spike.p99_normal_after_end_s, "spike": dataclasses.asdict(spike),
        "rss_growth_mb": rss_growth, "retry_requests": retry_sent, "retry_answered": sum(
            x.outcome != "lost" for x in retried), "retry_attempts": retry_wire,
        "retry_max_attempts_seen": max((x.attempts for x in retried), default=0),
        "retry_policy_max_attempts": RETRY.max_attempts, "retry_outcomes": dict(Counter(x.outcome for x in retried)),
        "shots": shots, "server_alive_after": alive, "server_ready_after": ready,
    }


# -- kill -9 --------------------------------------------------------------------------------------------------------
def kill9_under_load(repository: Path, state_dir: Path, model: str = "minilm", threads: int = 3,
                     protocol: str = "grpc") -> dict:
    """faults.KILL9_SERVER of our tritonserver under closed-loop callers, its ports held while it is down; restart it on
    the same ports (faults.restart_on_same_ports: else the record's `restart` says who took them); the same clients
    must come back. Every figure and the fault's faults.Outcome in one record."""
    settings = harness.server_settings(repository, state_dir, COST, port_range=faults.RESTART_PORTS)
    srv = harness.launch(settings)
    ports = (settings.http_port, settings.grpc_port, settings.metrics_port)  # as bound (start may have re-picked)
    url = srv.grpc_url if protocol == "grpc" else srv.http_url
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2, total_s=2.0)
    clients = [EmbeddingClient(url, model=model, protocol=protocol, timeout_s=5.0, retry=retry).connect()
               for _ in range(threads)]  # long-lived: the same objects before the kill and after the restart
    t0, sent, started = time.monotonic(), [0], [0.0] * threads
    log: list[tuple[faults.Shot, int]] = []  # (the request, its worker)
    odd: list[str] = []  # messages of errors that are not ServerUnavailable
    stop = threading.Event()

    def now() -> float:
        return time.monotonic() - t0

    def record(k: float, done: float, kind: str, error: BaseException | None) -> None:
        log.append((faults.Shot(started[int(k)], done, kind), int(k)))
        if error is not None and not isinstance(error, ServerUnavailable) and len(odd) < 5:
            odd.append(str(error)[:300])

    def every_worker(since: float, ok: bool, timeout_s: float) -> float | None:
        workers = set(range(threads))
        return wait_until(lambda: {w for x, w in list(log) if x.done > since and (x.outcome == "ok") == ok}
                          >= workers, timeout_s)

    def call(k: int) -> Awaitable[object]:
        started[k], sent[0] = now(), sent[0] + 1
        return asyncio.to_thread(clients[k].embed_documents, ["今天天气很好 hello"])

    loop = threading.Thread(target=lambda: asyncio.run(loadgen.closed_loop(call, threads, stop.is_set, record, 0.05,
                                                                            now)))
    loop.start()
    out: dict = {"protocol": protocol, "threads": threads, "ports": ports}
    o = faults.Outcome(faults.KILL9_SERVER, 0.0)
    try:
        every_worker(0.0, True, 60)
        time.sleep(1.0)
        out["ok_before_kill"] = sum(1 for x, _ in log if x.outcome == "ok")
        o.at_s, o.pid = now(), srv.pid
        stubs = faults.kill_server(srv.pid)  # the server this function started, by its pid
        srv.running.wait(timeout=10)
        srv.proc = None
        with faults.PortHold(ports) as hold:  # while it is down, a server started meanwhile cannot pick its ports
            out["ports_not_held_at_kill"] = hold.grab()
            out["all_workers_errored"] = every_worker(o.at_s, False, 120) is not None
            errs = {w: (x.done - o.at_s, x.outcome) for x, w in reversed(log) if x.done > o.at_s and x.outcome != "ok"}
            out["error_kinds_after_kill"] = dict(Counter(kind for _, kind in errs.values()))  # first error per worker
            out["max_time_to_error_s"] = max((d for d, _ in errs.values()), default=None)
            out.update(faults.clean_up_after_kill(stubs))  # our server's children only
            out["ports_not_held"] = hold.grab()  # the stubs may have held a port till now
        restart_t = now()
        new, o.restart = faults.restart_on_same_ports(settings)
        out["restart_s"] = out["same_clients_ok_after_restart_s"] = out["max_recovery_s"] = None
        if new is not None:
            srv, ready_at = new, now()
            out["restart_s"], o.ready_again_s = ready_at - restart_t, ready_at - o.at_s
            # from ready to every old client succeeding (120 s: a safety net, not a target)
            out["same_clients_ok_after_restart_s"] = back = every_worker(ready_at, True, 120)
            # recovery once a restart is issued; the wait for stubs to exit is reported apart (stubs_exited_...)
            out["max_recovery_s"] = None if back is None else out["restart_s"] + back
            threshold = faults.calm_p99([x for x, _ in log], o.at_s)[1]
            wait_until(lambda: faults.judge(o, [x for x, _ in list(log)], threshold, 1.0, now() - 1.0).recovered, 30,
                       0.5)  # the load goes on until the latency is back to normal too (30 s at most)
    finally:
        stop.set()
        loop.join(timeout=60)
        for c in clients:
            c.close()
        shots = [x for x, _ in log]
        if o.at_s:
            faults.judge(o, shots, faults.calm_p99(shots, o.at_s)[1], 1.0, now())
        out.update(outcomes=dict(Counter(x.outcome for x in shots)), requests=sent[0], answered=len(shots),
                   other_error_messages=odd, outcome=dataclasses.asdict(o), recovered=o.recovered,
                   restart=o.restart)
        srv.stop()
    return out


def kill_stub(repository: Path, state_dir: Path, model: str = "minilm", watch_s: float = 20.0) -> dict:
    """faults.KILL9_STUB of the encoder (a child of our server), and watch what Triton does: no restart here, so its
    faults.Outcome is not recovered (Triton 2.51 does not replace a dead stub; `server up --watch` restarts)."""
    srv = harness.start_server(repository, state_dir, COST, port_range=PORT_RANGE)
    try:
        client = EmbeddingClient(srv.grpc_url, model=model, timeout_s=10.0, retry=RetryPolicy.off()).connect()
        client.embed_documents(["warm"])
        out: dict = {"listening": sorted({(c.laddr.ip, c.laddr.port) for p in process_tree(srv.pid)
                                          for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})}
        before = stub_pids(srv.pid)  # a stub started after the kill has a pid not in here (the other instance has)
        killed_at = time.monotonic()
        [out["pid"]] = faults.kill_stub(srv.pid, f"{model}_onnx")  # a child of the server we started
        outcomes: list[tuple[str, float, str]] = []
        shots: list[faults.Shot] = []  # from the kill on
        first_ok = None
        while time.monotonic() - killed_at < watch_s and sum(o == "ok" for o, _, _ in outcomes) < 3:
            t = time.monotonic()
            try:
                client.embed_documents(["after the stub died"])
                outcomes.append(("ok", time.monotonic() - t, ""))
                first_ok = first_ok or time.monotonic() - killed_at
                shots.append(faults.Shot(t - killed_at, time.monotonic() - killed_at, "ok"))
            except KitError as exc:
                outcomes.append((type(exc).__name__, time.monotonic() - t, str(exc)[:300]))
                shots.append(faults.Shot(t - killed_at, time.monotonic() - killed_at, kind_of(exc)))
                time.sleep(0.2)
        http = HttpSync(srv.http_url)
        out.update(server_alive=srv.running.poll() is None, server_ready=http.ready(model, 2.0),
                   encoder_ready=http.ready(f"{model}_onnx", 2.0),
                   errors=[(o, round(d, 3), m) for o, d, m in outcomes if o != "ok"], first_ok_after_kill_s=first_ok,
                   new_stub=any(p not in before for p, c in stub_pids(srv.pid).items() if f"{model}_onnx" in c))
        o = faults.Outcome(faults.KILL9_STUB, 0.0, pid=out["pid"], restart="none: Triton does not replace a dead "
                           "python stub; restart the server (`bge-triton serve up --watch` does)")
        out["outcome"] = dataclasses.asdict(faults.judge(o, shots, math.inf, 1.0, time.monotonic() - killed_at))
        log = srv.log_path.read_text(errors="replace").splitlines()
        out["log_lines"] = [ln for ln in log if any(w in ln.lower() for w in ("stub", "unhealthy", "not healthy"))][-6:]
        client.close()
        http.close()
    finally:
        srv.stop()
    return out


# -- broken model files at start ------------------------------------------------------------------------------------
BREAKAGES: dict[str, Callable[[Path, str], object]] = {
    "onnx_missing": lambda r, m: (r / f"{m}_onnx" / "1" / "model.onnx").unlink(),
    "onnx_corrupt": lambda r, m: (r / f"{m}_onnx" / "1" / "model.onnx").write_bytes(b"\x00garbage" * 64),
    "tokenizer_missing": lambda r, m: shutil.rmtree(r / m / "1" / "tokenizer"),
    "config_corrupt": lambda r, m: (r / m / "config.pbtxt").write_text("name: \"x\"\nmax_batch_sise: 3\n"),
    "onnx_truncated": lambda r, m: (p := r / f"{m}_onnx" / "1" / "model.onnx").write_bytes(
        p.read_bytes()[: p.stat().st_size // 3]),
    "tokenizer_corrupt": lambda r, m: (r / m / "1" / "tokenizer" / "tokenizer.json").write_text("{not json"),
}


def broken_start(repository: Path, work_dir: Path, case: str, model: str = "minilm",
                 ready_timeout_s: float = 90.0) -> dict:
    """`bge-triton serve up` on a copy of the repository with one breakage; returns rc, time, message. It runs the
    command line (harness.serve_up), not harness.launch: what is tested is what a user sees, its exit code and words."""
    repo, state = work_dir / f"repo_{case}", work_dir / f"state_{case}"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(repository, repo, symlinks=False)
    BREAKAGES[case](repo, model)
    settings = harness.server_settings(repo, state, port_range=PORT_RANGE, ready_timeout_s=ready_timeout_s)
    t = time.monotonic()
    proc = harness.serve_up(settings, timeout_s=ready_timeout_s + 60)  # a server that came up anyway is stopped
    out = {"case": case, "rc": proc.returncode, "seconds": time.monotonic() - t, "stderr": proc.stderr.strip()}
    shutil.rmtree(repo, ignore_errors=True)
    return out


# -- the command -----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = flags.parser(COMMAND, __doc__ or "")
    flags.no_env(flags.add_url(p, None, help=URL_HELP), "BGE_TRITON_URL names the server of the other commands")
    p.add_argument("--repository", type=Path, default=None,
                   help="exported repository with NAME + NAME_onnx (default: export MiniLM into a temp dir)")
    flags.no_env(p.add_argument("--model", default="minilm", metavar="NAME",
                                help="the model NAME (+ NAME_onnx) in --repository that chaos serves"),
                 "BGE_TRITON_MODEL names the other commands' model, not the one chaos serves")
    p.add_argument("--out", type=Path, default=Path("reports/chaos"), help="report directory")
    p.add_argument("--quick", action="store_true", help="CI-sized: 1500 bad requests, 8 s of overload, 4 breakages")
    p.add_argument("--flood", type=int, default=None, help="bad requests in the RSS flood (default 10000)")
    p.add_argument("--overload-s", type=float, default=None, help="seconds at 3x capacity (default 60)")
    a, machine, t = flags.parse(p, argv), report.machine_info(), time.monotonic()
    if a.url is not None:
        print(f"error: --url {a.url}: {URL_HELP}", file=sys.stderr)
        return 2
    res: dict = {"out": a.out}
    with tempfile.TemporaryDirectory(prefix="kit-chaos-") as tmp:
        work = Path(tmp)
        repo = a.repository or work / "repo"
        if a.repository is None:
            harness.export("sentence-transformers/all-MiniLM-L6-v2", repo, "minilm", "fp32", "--quiet")
        try:  # every scenario in turn
            print("[1/5] bad-input catalogue + flood", flush=True)
            srv = harness.start_server(repo, work / "inputs", port_range=PORT_RANGE)
            try:
                res["catalogue"] = run_catalogue({"grpc": srv.grpc_url, "http": srv.http_url}, a.model)
                res["flood"] = flood(srv.grpc_url, a.model, srv.pid, a.flood or (1500 if a.quick else 10_000))
            finally:
                srv.stop()
            print("[2/5] overload at 3x capacity", flush=True)
            over_s = a.overload_s or (8.0 if a.quick else 60.0)
            res["overload"] = run_overload(repo, work / "overload", a.model, overload_s=over_s)
            print("[3/5] kill -9 of tritonserver under load (gRPC, HTTP)", flush=True)
            res["kill9"] = [kill9_under_load(repo, work / f"kill9_{p}", a.model, protocol=p) for p in ("grpc", "http")]
            print("[4/5] kill -9 of a python backend stub", flush=True)
            res["stub"] = kill_stub(repo, work / "stub", a.model, watch_s=5.0 if a.quick else 30.0)
            print("[5/5] broken model files at start", flush=True)
            res["broken"] = [broken_start(repo, work, c, a.model) for c in list(BREAKAGES)[:4 if a.quick else 6]]
        except KitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    res["seconds"] = time.monotonic() - t
    path = write_report(res, " ".join([COMMAND, *argv]), a.model, machine)
    s = summary(res)
    print(f"wrote {path}: {s['requests_sent']} requests, lost {s['requests_lost']}, max recovery "
          f"{report.fmt(s['max_recovery_s'], 2)} s, RSS growth {s['rss_growth_mb_flood']:+.1f} MiB")
    return 0 if s["requests_lost"] == 0 and s["catalogue_problems"] == 0 else 1

"""`bge-triton bench soak --duration 20m`: a long run
at 70% of the capacity measured in the same run, with a kill -9 of the server, a dead python stub and an
overload spike along the way, recovered from the way a user runs the kit: the server under
`python -m bge_triton.server up --watch` (its canary restarts it), clients through the SDK with its RetryPolicy.

Writes reports/soak/soak.md + soak.csv + soak_p99.png: requests sent / ok / failed / lost (lost must be 0),
server and client RSS drift, recovery times, p99 per minute. The encoder is EMULATED (costmodel executor).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bge_triton.client import AsyncEmbeddingClient, KitError, Overloaded, RetryPolicy, ServerUnavailable
from bge_triton.errors import InputError, Timeout
from bge_triton.loadtest import corpus, loadgen
from bge_triton.loadtest.soak_analysis import (
    PlannedEvent,
    Shot,
    ShotLog,
    baseline_p99,
    bin_shots,
    first_ok_after,
    normal_threshold,
    p99_back_after,
    parse_duration,
    plan_events,
    window_p99,
    window_width,
)
from bge_triton.loadtest.soak_watch import MODEL, Watcher, shipped_repository

COMMAND = "bge-triton bench soak"


@dataclass(frozen=True)
class SoakSettings:
    """Built once from flags."""

    duration_s: float
    out: Path
    load_fraction: float = 0.7
    spike_factor: float = 3.0
    spike_s: float = 30.0
    probe_s: float = 20.0
    probe_users: int = 32
    watch_s: float = 1.0
    sample_s: float = 5.0
    bucket_s: float = 60.0
    max_chars: int = 128
    timeout_s: float = 10.0  # per attempt (the SDK's default)
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # the SDK's default policy
    recover_timeout_s: float = 180.0  # give a recovery up after this long without progress (_wait_recovered)
    stub_kill: str = "one"  # or "all": the stubs of every encoder instance
    seed: int = 0
    argv: tuple[str, ...] = ()

    @property
    def deadline_s(self) -> float:
        """After this long a request with neither a result nor an error is LOST (the SDK must answer sooner)."""
        return self.retry.total_s + self.timeout_s + 10.0

    @property
    def command(self) -> str:
        return " ".join([COMMAND, *self.argv])


def _kind(exc: BaseException) -> str:
    if isinstance(exc, Overloaded):
        return "Overloaded"
    if isinstance(exc, Timeout):
        return "Timeout"
    if isinstance(exc, ServerUnavailable):
        return "ServerUnavailable"
    if isinstance(exc, KitError):
        return type(exc).__name__
    return f"raw:{type(exc).__name__}"  # not a KitError: an SDK defect, counted as an error and named


class Soak:
    """One soak run over a started Watcher: probe, open-loop load, fault events, resource samples."""

    def __init__(self, s: SoakSettings, watcher: Watcher):
        self.s, self.w = s, watcher
        self.texts = corpus.sample("reviews", 2000, seed=s.seed, max_chars=s.max_chars)
        self.shots = ShotLog()
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.mult = 1.0
        self.events_done = False
        self.pending: dict[int, float] = {}  # id -> scheduled time of the requests in flight
        self.messages: dict[str, list[str]] = {}  # error kind -> its first messages
        self.width = window_width(s.duration_s)
        self.threshold = math.inf  # p99 'back to normal' (set from the calm stretch at the first fault)
        self.t0 = 0.0
        self.me = psutil.Process()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _one(self, client: AsyncEmbeddingClient, sched: float, text: str, key: int) -> None:
        self.pending[key] = sched
        task = asyncio.ensure_future(client.embed_documents([text]))
        done, _ = await asyncio.wait({task}, timeout=self.s.deadline_s)
        self.pending.pop(key, None)
        if not done:  # neither a result nor an error within the deadline
            task.cancel()
            outcome = "lost"
        elif (error := task.exception()) is not None:
            outcome = _kind(error)
            seen = self.messages.setdefault(outcome, [])
            if len(seen) < 3 and str(task.exception())[:300] not in seen:
                seen.append(str(task.exception())[:300])
        else:
            vec = task.result()
            outcome = "ok" if vec.shape == (1, 1024) else f"wrong_shape:{vec.shape}"
        self.shots.append(sched, self.now(), outcome)

    async def probe(self, client: AsyncEmbeddingClient) -> float:
        """Texts per second sustained closed-loop by probe_users users (same client, texts and server)."""
        done, stop = 0, time.monotonic() + self.s.probe_s
        rng = random.Random(self.s.seed + 1)

        async def user() -> None:
            nonlocal done
            while time.monotonic() < stop:
                try:
                    await client.embed_documents([rng.choice(self.texts)])
                    done += 1
                except KitError:
                    await asyncio.sleep(0.05)

        t = time.monotonic()
        await asyncio.gather(*(user() for _ in range(self.s.probe_users)))
        return done / (time.monotonic() - t)

    async def _sampler(self) -> None:
        while True:
            pid, rss = await asyncio.to_thread(self.w.rss_mb)
            self.samples.append({"t": self.now(), "server_pid": pid, "server_rss_mb": rss,
                                 "client_rss_mb": self.me.memory_info().rss / 2**20,
                                 "loadavg1": os.getloadavg()[0]})
            await asyncio.sleep(self.s.sample_s)

    def _p99_back(self, fault_t: float, index: int) -> float | None:
        """p99_back_after on what is known now: requests still in flight count as failures, and only windows
        that ended at least one threshold ago are judged (an answer still missing by then is too slow anyway)."""
        view = self.shots.view(index, fault_t)
        view += [Shot(t, math.inf, "pending") for t in list(self.pending.values()) if t >= fault_t]
        return p99_back_after(view, fault_t, self.threshold, self.width, self.now() - min(self.threshold, 30.0))

    def _progress(self, fault_t: float, index: int, restart: bool) -> tuple[int, float]:
        """How far the recovery from the fault at fault_t has come: the stages reached (restarted when the fault
        needs it, a success since, p99 back to normal) and the lowest p99 of a window ended since the fault."""
        restarted = not restart or any(t - self.t0 > fault_t for t in self.w.ready_again())
        view = self.shots.view(index, fault_t)
        first_ok = first_ok_after(view, fault_t) is not None
        back = restarted and first_ok and self._p99_back(fault_t, index) is not None
        bins = bin_shots(view, fault_t, self.width)
        ended = int((self.now() - fault_t) / self.width)
        best = min((window_p99(bins.get(k, []), fault_t + k * self.width, self.width)[0] for k in range(ended)),
                   default=math.inf)
        return int(restarted) + int(first_ok) + int(back), best

    async def _wait_recovered(self, fault_t: float, index: int, restart: bool) -> None:
        """Until the watcher restarted the server (when the fault needs it), a request sent since succeeded and
        the p99 is back to normal. Bounded by progress, not by a wall-clock budget: the wait gives up (the report
        then says 'not recovered') only after recover_timeout_s in which nothing moved - no stage reached, no
        window p99 lower than any before - so a slow restart on a busy machine is waited for, a stuck one not."""
        stages, best = self._progress(fault_t, index, restart)
        moved_at = self.now()
        while stages < 3 and self.now() - moved_at < self.s.recover_timeout_s:
            await asyncio.sleep(1.0)
            now_stages, now_best = self._progress(fault_t, index, restart)
            if now_stages > stages or now_best < best:
                moved_at = self.now()
            stages, best = max(stages, now_stages), min(best, now_best)

    async def _events(self, plan: list[PlannedEvent], settle_s: float) -> None:
        ready_at = 0.0
        for ev in plan:
            await asyncio.sleep(max(0.0, max(ev.at, ready_at) - self.now()))
            t, index = self.now(), len(self.shots)
            if math.isinf(self.threshold):
                self.threshold = normal_threshold(baseline_p99(self.shots.view(), 0.0, t))
            row = {"kind": ev.kind, "planned_s": ev.at, "at_s": t, "length_s": ev.length, "pid": 0}
            try:
                if ev.kind == "kill9_server":
                    row["pid"] = await asyncio.to_thread(self.w.kill_server)
                elif ev.kind == "kill9_stub":
                    row["pid"] = await asyncio.to_thread(self.w.kill_stub, every_instance=self.s.stub_kill == "all")
            except KitError as exc:  # no server to kill (still restarting): the report says so, the soak goes on
                row["error"] = str(exc)
                print(f"[{t:7.1f} s] {ev.kind} not injected: {exc}", flush=True)
            if ev.kind == "overload_spike":
                self.mult = self.s.spike_factor
                await asyncio.sleep(ev.length)
                self.mult = 1.0
            self.events.append(row)
            print(f"[{t:7.1f} s] {ev.kind} (pid {row['pid']})", flush=True)
            if "error" not in row:
                await self._wait_recovered(t, index, restart=ev.kind != "overload_spike")
            ready_at = self.now() + settle_s
        await asyncio.sleep(4 * self.width)  # a tail after the last recovery, for the report's windows
        self.events_done = True

    async def run(self) -> dict:
        s = self.s
        client = AsyncEmbeddingClient(f"127.0.0.1:{self.w.grpc}", model=MODEL, timeout_s=s.timeout_s, retry=s.retry)
        await client.connect()
        for text in self.texts[:20]:  # warm: first calls start the stubs' lazy paths
            await client.embed_documents([text])
        capacity = await self.probe(client)
        rate = s.load_fraction * capacity
        print(f"capacity {capacity:.1f} texts/s closed-loop ({s.probe_users} users, {s.probe_s:.0f} s); "
              f"soak at {rate:.1f}/s for {s.duration_s:.0f} s", flush=True)
        plan = plan_events(s.duration_s, s.spike_s)
        settle = self.width
        self.t0 = time.monotonic()
        tasks: set[asyncio.Task] = set()
        sampler = asyncio.ensure_future(self._sampler())
        events = asyncio.ensure_future(self._events(plan, settle))
        t, i, sent = 0.0, 0, 0
        # the load runs until the events are done (each recovery wait is bounded by progress) and the soak's length
        async for t in loadgen.poisson(random.Random(s.seed), lambda: rate * self.mult, self.now, 0.0):
            if self.events_done and t >= s.duration_s or events.done() and events.exception():
                break
            task = asyncio.ensure_future(self._one(client, t, self.texts[i % len(self.texts)], i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i, sent = i + 1, sent + 1
        end = t
        if tasks:
            await asyncio.wait(tasks, timeout=s.deadline_s + 5)
        events.cancel()
        await asyncio.sleep(s.sample_s if s.sample_s < 2 else 1.0)
        sampler.cancel()
        await client.close()
        return {"capacity_rps": capacity, "rate_rps": rate, "end_s": end, "created": sent,
                "unfinished": sent - len(self.shots), "events": self.events, "messages": self.messages,
                "records_mb": self.shots.nbytes() / 2**20}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", required=True, metavar="DURATION", help="how long: 20m, 3m, 40s, 1h30m")
    p.add_argument("--out", type=Path, default=Path("reports/soak"), help="report directory (default reports/soak)")
    p.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity (default 0.7)")
    p.add_argument("--spike-factor", type=float, default=3.0, help="overload spike, x the capacity (default 3)")
    p.add_argument("--spike-s", type=float, default=30.0, help="spike length; a short soak shortens it to 8%% of it")
    p.add_argument("--probe-s", type=float, default=None, help="closed-loop capacity probe (default 20 s; 3 s "
                   "for a soak under 2 min)")
    p.add_argument("--bucket-s", type=float, default=60.0, help="report row width (default a minute)")
    p.add_argument("--stub-kill", choices=["one", "all"], default="one",
                   help="the dead stub: one of the encoder's two instances (default; the canary finds it only when "
                        "Triton routes the canary there) or every instance (found at the next canary)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str]) -> SoakSettings:
    a = _parser().parse_args(argv)
    duration = parse_duration(a.duration)
    if not 0 < a.load <= 1.5 or a.spike_factor <= 1:
        raise InputError(f"--load {a.load} / --spike-factor {a.spike_factor}: need 0 < load <= 1.5, factor > 1")
    short = duration < 120
    return SoakSettings(duration_s=duration, out=a.out, load_fraction=a.load, spike_factor=a.spike_factor,
                        spike_s=a.spike_s, probe_s=a.probe_s or (3.0 if short else 20.0),
                        sample_s=1.0 if short else 5.0, bucket_s=a.bucket_s, seed=a.seed, stub_kill=a.stub_kill,
                        argv=tuple(argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        s = parse_args(argv)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from bge_triton.loadtest.report import machine_line
    from bge_triton.loadtest.soak_report import summarize, write_report

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kit-soak-") as tmp:
        repo = shipped_repository(Path(tmp) / "repo")
        watcher = Watcher(repo, Path(tmp) / "state", watch_s=s.watch_s)
        load_start = os.getloadavg()
        watcher.start()
        soak = Soak(s, watcher)
        try:
            res = asyncio.run(soak.run())
        finally:
            cleanup = watcher.stop()
    res.update(cleanup=cleanup, restarts=[(t - soak.t0, why) for t, why in watcher.restarts()],
               ready_again=[t - soak.t0 for t in watcher.ready_again()], watch_command=watcher.command,
               old_logs=watcher.old_logs,
               machine=machine_line(load_start), loadavg_end=os.getloadavg(), wall_s=time.time() - started)
    shots = soak.shots.view()
    summary = summarize(res, shots, soak.samples, s)
    path = write_report(res, summary, shots, soak.samples, s)
    t = summary["tally"]
    print(f"wrote {path}: sent {t['sent']}, ok {t['ok']}, failed {t['failed']}, lost {t['lost']}")
    return 0 if t["lost"] == 0 and summary["all_recovered"] else 1

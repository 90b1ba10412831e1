"""`bge-triton bench seed --url HOST:PORT`: the seed's table on a Triton you run. Each scenario (batch 1, static 32,
dynamic 5 ms, delay 0) is the encoder's SERVED config with only its batching fields changed, loaded as a config
override (explicit model control; the restricted API's key with --admin-key); the text endpoint row runs the served
configs as they are. The served config is loaded back after each scenario, on success, failure and Ctrl-C.
Writes OUT/seed.md, seed.csv and seed.png (p50 and p99 against throughput, six or more loads per scenario).
Without --url, `bench seed` starts a local server of its own (`bge-triton bench seed --help` gives its flags)."""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bge_triton import flags
from bge_triton.errors import InputError, KitError
from bge_triton.loadtest import curves, engine, report
from bge_triton.loadtest.scenarios import SCENARIOS, SEED
from bge_triton.loadtest.target import (
    Target,
    add_target_flags,
    batches_text,
    opening,
    override_config,
    target_from,
    tokenizer_path,
)

FIELDS = ("scenario", "load", "users", "sent", "throughput", "avg_ms", "p50_ms", "p99_ms", "n", "errors",
          "avg_batch", "batches", "gpu_util", "cpu_util", "first_error")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise InputError(f"{flag} {text!r}: expected a comma list of whole numbers, e.g. 1,2,4,8,16,32") from exc
    if len(values) < 1 or min(values) < 1:
        raise InputError(f"{flag} {text!r}: give at least one count, each >= 1")
    return values


def parse_args(argv: Sequence[str]) -> Any:
    p = flags.parser("bge-triton bench seed", (__doc__ or "").split("\n\n")[0])
    add_target_flags(p)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--users", default="1,2,4,8,16,32,64", help="closed-loop users, one window each (the curve's "
                   "offered loads; six or more draw a curve)")
    p.add_argument("--static-users", default="32,64,96,128,160,192", help="static_32's users: multiples of 32, so "
                   "every batch fills (a static batcher holds a part batch until its 10 s delay)")
    p.add_argument("--duration", type=float, default=None, help="seconds measured per window (default 8; 1 quick)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per window (default 2; 0.3 quick)")
    p.add_argument("--quick", action="store_true", help="short windows (a first look, or a test)")
    p.add_argument("--out", type=Path, default=report_dir(), help="report directory")
    a = flags.parse(p, argv)
    if not a.url:
        p.error("--url is required here (or BGE_TRITON_URL)")
    a.scenarios = tuple(s for s in a.scenarios.split(",") if s)
    if bad := [s for s in a.scenarios if s not in SCENARIOS]:
        raise InputError(f"--scenarios: unknown {bad[0]!r}; choose from {', '.join(SCENARIOS)}")
    a.users, a.static_users = _ints(a.users, "--users"), _ints(a.static_users, "--static-users")
    a.duration = a.duration if a.duration is not None else (1.0 if a.quick else 8.0)
    a.warmup = a.warmup if a.warmup is not None else (0.3 if a.quick else 2.0)
    a.command = "bge-triton bench seed " + " ".join(x if x != a.admin_key else "$KEY" for x in argv)
    return a


def report_dir() -> Path:
    from bge_triton.paths import REPORTS_DIR

    return REPORTS_DIR / "bench" / "url"


def run(target: Target, a: Any, texts: engine.Texts) -> list[dict]:
    """Every scenario over its offered loads; the encoder's served config back after each one."""
    rows: list[dict] = []
    for scenario in a.scenarios:
        knobs = SCENARIOS[scenario]
        make = None if knobs is None else (lambda served, k=knobs: override_config(served, k))
        model = target.model if knobs is None else target.encoder
        with target.overriding(target.encoder, make):
            inputs = [i.name for i in target.config(model).input]
            for users in a.static_users if scenario == "static_32" else a.users:
                point = engine.measure(target, model, inputs, texts, engine.Load(users=users), a.warmup, a.duration)
                row = {**point.row(), "scenario": scenario, "batches": batches_text(point.batches)}
                if point.front_batches:  # the text endpoint's own batches, then what reached the encoder
                    row["batches"] = f"text {batches_text(point.front_batches)}; encoder {row['batches']}"
                rows.append(row)
                print(f"{scenario:13s} C={users:<4d} {row['throughput']:8.1f} req/s  avg {report.fmt(row['avg_ms'])}"
                      f"  p50 {report.fmt(row['p50_ms'])}  p99 {report.fmt(row['p99_ms'])} ms  batches "
                      f"{row['batches']}  {curves.util_text(row)}  errors {row['errors']}", flush=True)
    return rows


def write(rows: list[dict], target: Target, a: Any, texts: engine.Texts, load0: Sequence[float]) -> list[Path]:
    f = report.fmt
    lines = curves.header(target, texts.seq_len, len(texts.texts), load0,
                          f"{a.warmup:g} s warm-up + {a.duration:g} s per offered load, closed loop (C users back to "
                          f"back; static_32 at C = {', '.join(map(str, a.static_users))}, the others at C = "
                          f"{', '.join(map(str, a.users))})")
    lines += ["## The seed table on this server", "",
              "Peak = the offered load with the highest throughput; batches = the encoder's executions per batch "
              "size in that window (Triton's batch_stats), with the mean; utilisation = Triton's nv_gpu_utilization "
              "/ nv_cpu_utilization gauges averaged over the window. The A10G columns are the published figures "
              "(another machine, the seed's own asyncio batcher), not measured here.", ""]
    table = []
    for sc in a.scenarios:
        pts = [r for r in rows if r["scenario"] == sc]
        pk = max(pts, key=lambda r: r["throughput"])
        low = min(pts, key=lambda r: r["users"])
        seed = SEED.get(sc)
        table.append([sc, f"{pk['throughput']:.0f}", pk["load"], pk["avg_ms"], pk["p50_ms"], pk["p99_ms"],
                      pk["batches"], curves.util_text(pk), f"{f(low['p50_ms'])} / {f(low['p99_ms'])} ({low['load']})",
                      sum(r["errors"] for r in pts),
                      " / ".join(map(str, seed)) if seed else "-"])
    lines += report.table("scenario | peak QPS | at | avg ms | p50 ms | p99 ms | batches Triton formed | "
                          "utilisation | p50 / p99 ms at the lowest load | errors | A10G seed: QPS / avg / P99 / util",
                          table)
    lines += ["", "A text endpoint whose encoder runs in-process (the kit's local CPU variant) calls no encoder model: "
              "its row shows the text endpoint's own batches and `encoder -`. Errors with the first of them are "
              "listed below: the served queue policy (timeout, max size) stays as the server has it.", "",
              "![p50 and p99 against throughput](seed.png)", "",
              "Each curve runs through its offered loads in order (the square: the lowest load).", "",
              "## Every offered load", "",
              *report.table("scenario | load | req/s | avg ms | p50 ms | p99 ms | batches | utilisation | errors",
                            [[r["scenario"], r["load"], f"{r['throughput']:.1f}", r["avg_ms"], r["p50_ms"],
                              r["p99_ms"], r["batches"], curves.util_text(r), r["errors"]] for r in rows])]
    if errs := [r for r in rows if r["first_error"]]:
        lines += ["", "First error per window with errors:", "",
                  *(f"- {r['scenario']} {r['load']}: `{r['first_error']}`" for r in errs)]
    return [report.write_md(a.out / "seed.md", a.command, "Bench seed: the seed table on a running Triton", lines),
            report.write_csv(rows, FIELDS, a.out / "seed.csv", a.command),
            curves.plot_curves(rows, "scenario", a.out / "seed.png", a.command, f"{target.model} at {target.url}",
                               "same texts on every curve")]


def main(argv: Sequence[str] | None = None) -> int:
    a, load0, t0 = opening(parse_args, argv)
    target = None
    try:
        target = target_from(a)
        texts = engine.load_texts(tokenizer_path(a), a.seq_len)
        rows = run(target, a, texts)
    except KeyboardInterrupt:
        print("interrupted: the served config was loaded back; no report written", file=sys.stderr)
        return 130
    except KitError as exc:  # the served config is back already (Target.overriding)
        print(f"bge-triton bench seed: {exc}", file=sys.stderr)
        return 2
    finally:
        if target is not None:
            target.close()
    paths = write(rows, target, a, texts, load0)
    print(f"bench seed done in {time.monotonic() - t0:.0f} s: " + ", ".join(map(str, paths)))
    return 0

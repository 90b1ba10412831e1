"""`bge-triton tune --slo-p99-ms X --rate R`: sweep the batcher's queue delay and preferred sizes.

Each candidate config is loaded (no restarts) and driven by an open-loop Poisson load at R req/s. The pick: the highest
goodput meeting the SLO (p99 <= X, errors <= 1%); within 2% of it, the lowest p99; --write puts it into the config.
`tune pair`: `bench shipped` over a grid of encoder and text-endpoint settings; `tune pair --write` writes both.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from bge_triton import flags
from bge_triton.errors import InputError
from bge_triton.extras import require
from bge_triton.loadtest import core, harness, loadgen, report
from bge_triton.loadtest.core import BenchSettings, add_common_flags, add_flags, preferred_sets
from bge_triton.paths import REPORTS_DIR, STATE_DIR
from bge_triton.repository import DEFAULT_CANONICAL, ENCODER_SUFFIX, Batching, update_batching_in_place

require("loadtest", "bge-triton tune")

TUNE_FIELDS = ("delay_us", "preferred", "rate", "goodput", "p50_ms", "p99_ms", "n", "errors", "avg_batch",
               "queue_ms", "compute_ms", "meets_slo", "picked")


@dataclass(frozen=True)
class TuneSettings(BenchSettings):
    """The harness's one settings type (core.BenchSettings) with the tuner's defaults, grid and SLO."""

    out: Path = REPORTS_DIR / "tune"
    warmup_s: float = 1.0
    duration_s: float = 6.0
    state_dir: Path = STATE_DIR / "loadtest" / "tune_state"
    command: str = "bge-triton tune"
    slo_p99_ms: float = 0.0
    rate: float = 0.0
    write: bool = False
    target: Path = DEFAULT_CANONICAL / f"bge_large_zh{ENCODER_SUFFIX}"
    executor: str = "costmodel"
    delays_us: tuple[int, ...] = (0, 1000, 2000, 5000, 10000, 20000)
    preferred: tuple[tuple[int, ...], ...] = ((), (16, 32), (32,))
    repeats: int = 1  # rounds over the grid; a candidate's p99 = median over rounds (noisy shared machines)
    max_error_rate: float = 0.01


@dataclass
class TuneRun:
    settings: TuneSettings
    rows: list[dict] = field(default_factory=list)
    picked: dict | None = None
    selfcheck_rps: float = 0.0
    machine: dict = field(default_factory=report.machine_info)  # taken when the run starts


def choose(rows: list[dict], slo_p99_ms: float, max_error_rate: float = 0.01, tie: float = 0.02) -> dict | None:
    """Highest goodput meeting the SLO; within `tie` of it, lowest p99, then the shorter delay."""
    for r in rows:
        sent = r["n"] + r["errors"]
        r["meets_slo"] = bool(r["n"]) and r["p99_ms"] <= slo_p99_ms and r["errors"] <= max_error_rate * max(sent, 1)
    ok = [r for r in rows if r["meets_slo"]]
    best = max((r["goodput"] for r in ok), default=0.0)
    return min((r for r in ok if r["goodput"] >= (1 - tie) * best), default=None,
               key=lambda r: (r["p99_ms"], r["delay_us"], len(r["preferred"])))


def combine(rounds: list[dict]) -> dict:
    """One candidate over repeated rounds: median p50/p99, mean goodput, summed counts."""
    if len(rounds) == 1:
        return rounds[0]
    row = dict(rounds[0])
    for key in ("p50_ms", "p99_ms", "queue_ms", "compute_ms", "avg_batch"):
        row[key] = statistics.median(r[key] for r in rounds)
    row["goodput"] = statistics.fmean(r["goodput"] for r in rounds)
    row["n"], row["errors"] = sum(r["n"] for r in rounds), sum(r["errors"] for r in rounds)
    return row


def measure_candidate(h: harness.Harness, s: TuneSettings, model: str, delay: int, pref: tuple[int, ...]) -> dict:
    """Load one candidate config and drive it at the target rate (core.measure's open loop, s.duration_s)."""
    params = {"cost_a_us": s.cost.a_us, "cost_b_us": s.cost.b_us} if s.executor == "costmodel" else {}
    h.load(model, Batching(preferred_batch_sizes=pref, max_queue_delay_us=delay), executor=s.executor, params=params)
    r = core.measure(h, replace(s, low_duration_s=s.duration_s), model, [model],
                      tuple(loadgen.tensor_bodies(s.seq_len, 128)), "open", rate=s.rate)
    row = {**{k: r[k] for k in TUNE_FIELDS if k in r}, "delay_us": delay, "preferred": pref, "rate": s.rate,
           "goodput": r["throughput"], "meets_slo": False, "picked": False}
    print(f"delay {delay:>7d} us  preferred {list(pref)!s:10s}: goodput {row['goodput']:7.1f}/s  p50 "
          f"{row['p50_ms']:7.1f}  p99 {row['p99_ms']:7.1f} ms  batch {row['avg_batch']:5.1f}  errors {row['errors']}",
          flush=True)
    return row


def run_tune(s: TuneSettings) -> TuneRun:
    run, real = TuneRun(s), s.executor == "onnxruntime"
    model = (s.real_name if real else harness.EMULATED) + ENCODER_SUFFIX
    with core.stand(s, "tune_repo", real, 64) as h:
        run.selfcheck_rps = h.self_check_result.throughput if h.self_check_result else 0.0
        rounds = [[measure_candidate(h, s, model, delay, pref) for pref in s.preferred for delay in s.delays_us]
                  for _ in range(max(1, s.repeats))]
        run.rows = [combine(list(same)) for same in zip(*rounds, strict=True)]
    run.picked = choose(run.rows, s.slo_p99_ms, s.max_error_rate)
    if run.picked:
        run.picked["picked"] = True
    return run


def _label(r: dict) -> str:
    return f"delay {r['delay_us']} us, preferred {list(r['preferred']) or 'none'}"


def write_tune(run: TuneRun, out: Path) -> list[Path]:
    """tune.md, tune.csv, tune.png: every candidate, the SLO, the pick."""
    s, m, p = run.settings, run.machine, run.picked
    emu = (f"EMULATED GPU (cost model: a={s.cost.a_us:.0f} us, b={s.cost.b_us:.2f} us/token, {s.cost.source})"
           if s.executor == "costmodel" else f"real model {s.real_name} on ONNX Runtime (CPU)")
    pick = (f"**{_label(p)}**: goodput {p['goodput']:.0f} req/s, p99 {p['p99_ms']:.1f} ms" if p
            else "**none meets the SLO**: lower the rate, raise the SLO, or add capacity")
    lines = [*report.header(m), f"Model: {emu}; {s.seq_len} tokens per request.  ",
             f"Load: open-loop Poisson at {s.rate:g} req/s, {s.duration_s:g} s per candidate after {s.warmup_s:g} s "
             f"warm-up, {s.repeats} round(s) over the grid (p50/p99: median over rounds); SLO p99 <= "
             f"{s.slo_p99_ms:g} ms and errors <= {s.max_error_rate:.0%}.  ",
             f"Load-generator self-check: {run.selfcheck_rps:.0f} req/s against a no-op model "
             f"({'fine' if s.rate < 0.5 * run.selfcheck_rps else 'CLOSE TO THE GENERATOR CEILING'} for {s.rate:g} "
             "req/s).", "", f"Pick: {pick}." + (f" Written to `{s.target}/config.pbtxt`." if s.write and p else ""), "",
             *report.table("delay us | preferred | goodput req/s | p50 ms | p99 ms | batch | queue ms | compute ms | "
                           "errors | SLO", ([r["delay_us"], list(r["preferred"]) or "none", f"{r['goodput']:.0f}",
                                            r["p50_ms"], r["p99_ms"], r["avg_batch"], r["queue_ms"], r["compute_ms"],
                                            r["errors"], "**picked**" if r["picked"] else
                                            ("yes" if r["meets_slo"] else "no")] for r in run.rows)),
             "", "![p99 and goodput vs queue delay](tune.png)"]
    csv_rows = [{**r, "preferred": " ".join(map(str, r["preferred"])) or "none"} for r in run.rows]
    fig, (a1, a2) = report.subplots(2, 6.0, 4.5)
    for pref in s.preferred:
        pts = [r for r in run.rows if r["preferred"] == pref]
        for ax, key in ((a1, "p99_ms"), (a2, "goodput")):
            ax.plot([max(r["delay_us"], 100) / 1000 for r in pts], [r[key] for r in pts], "o-",
                    label=f"preferred {list(pref) or 'none'}")
    a1.axhline(s.slo_p99_ms, color="r", ls="--", label="SLO")
    a2.axhline(s.rate, color="k", ls=":", label="offered rate")
    a1.set(yscale="log", ylabel="p99 latency (ms)")
    a2.set(ylim=(0, 1.15 * max([s.rate] + [r["goodput"] for r in run.rows])), ylabel="goodput (req/s)")
    for ax in (a1, a2):
        ax.set(xscale="log", xlabel="max_queue_delay (ms; 0 drawn at 0.1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(("EMULATED " if s.executor == "costmodel" else "") + f"tuning at {s.rate:g} req/s", fontsize=10)
    return [report.write_md(out / "tune.md", s.command, "Tune: queue delay and preferred sizes", lines),
            report.write_csv(csv_rows, TUNE_FIELDS, out / "tune.csv", s.command),
            report.save_figure(fig, out / "tune.png", s.command)]


def parse_args(argv: list[str] | None = None) -> TuneSettings:
    p = flags.parser("bge-triton tune", __doc__.split("\n\n")[0],
                                epilog="`bge-triton tune pair [--write]`: the encoder AND the text endpoint together "
                                "(`tune pair --help`). On a Triton you run: `bge-triton tune --url HOST:PORT --help` "
                                "(docs/tuning.md).")
    p.add_argument("--slo-p99-ms", type=float, required=True, help="p99 latency objective (ms)")
    p.add_argument("--rate", type=float, required=True, help="offered load, requests per second (open loop)")
    add_common_flags(p, TuneSettings())
    add_flags(p, ("write", False, "write the pick into --target's config.pbtxt"),
              ("target", TuneSettings.target, "model dir --write updates"))
    p.add_argument("--executor", choices=("costmodel", "onnxruntime"), default="costmodel",
                   help="costmodel = EMULATED GPU on the canonical config; onnxruntime = --real-repo model on CPU")
    add_flags(p, ("delays-us", "0,1000,2000,5000,10000,20000", "max_queue_delay candidates (comma list)"),
              ("preferred", "none;16,32;32", "preferred-size sets, ';'-separated ('none' = none)"),
              ("seq-len", 64, "tokens per request"), ("duration", 6.0, "seconds measured per candidate"),
              ("repeats", 1, "rounds over the grid; p99 = median over rounds"),
              ("warmup", 1.0, "warm-up seconds per candidate"))
    a = flags.parse(p, argv)
    if a.rate <= 0 or a.slo_p99_ms <= 0:
        raise InputError(f"--rate ({a.rate}) and --slo-p99-ms ({a.slo_p99_ms}) must be positive")
    return core.from_flags(a, TuneSettings(), "bge-triton tune " + " ".join(sys.argv[1:] if argv is None else argv),
                            delays_us=tuple(int(v) for v in a.delays_us.split(",")), warmup_s=a.warmup,
                            preferred=preferred_sets(a.preferred), duration_s=a.duration,
                            **{k: getattr(a, k) for k in ("slo_p99_ms", "rate", "write", "target", "executor",
                                                          "seq_len", "repeats")})


def main(argv: list[str] | None = None) -> int:
    s = parse_args(sys.argv[1:] if argv is None else argv)
    run = run_tune(s)
    if s.write and run.picked:
        path = update_batching_in_place(s.target, Batching(preferred_batch_sizes=run.picked["preferred"],
                                                           max_queue_delay_us=run.picked["delay_us"]))
        print(f"wrote {_label(run.picked)} into {path}")
    paths = write_tune(run, s.out)
    print("pick:", _label(run.picked) if run.picked else "none meets the SLO", "|", ", ".join(map(str, paths)))
    return 0 if run.picked else 2

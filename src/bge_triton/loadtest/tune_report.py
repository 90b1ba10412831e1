"""The report of `bge-triton tune --url`: every candidate at every load, the candidates' objective, the pick and its
config diff (tune.md, tune.csv, tune_candidates.csv), the grid (tune.png: p99 against delay per rate, the objective
per candidate, the pick) and the latency-throughput curves (tune_curves.png: p50 and p99 against throughput)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bge_triton.loadtest import curves, report
from bge_triton.loadtest.target import Target

FIELDS = ("candidate", "delay_us", "preferred", "kind", "load", "rate", "sent", "throughput", "avg_ms", "p50_ms",
          "p99_ms", "n", "errors", "avg_batch", "gpu_util", "cpu_util", "first_error")
SUMMARY = ("candidate", "delay_us", "preferred", "objective_p99_ms", "sent", "errors", "reload_errors", "served",
           "meets_slo", "picked")


def plot_grid(rows: Sequence[dict], summary: Sequence[dict], slo_ms: float, path: Path, command: str,
              note: str) -> Path:
    """Left: p99 against max_queue_delay, a line per (rate, preferred set); right: each candidate's objective."""
    fig, (a1, a2) = report.subplots(2, 6.5, 4.8)
    steady = [r for r in rows if r["kind"] == "steady"]
    for pref in dict.fromkeys(r["preferred"] for r in steady):
        for rate in sorted({r["rate"] for r in steady}):
            pts = sorted((max(r["delay_us"], 100) / 1000, r["p99_ms"]) for r in steady
                         if r["preferred"] == pref and r["rate"] == rate)
            a1.plot(*zip(*pts, strict=True), "o-" if pref == "none" else "s--", ms=3,
                    label=f"{rate:g}/s, pref {pref}")
    a1.axhline(slo_ms, color="r", ls=":", label="SLO")
    a1.set(xscale="log", yscale="log", xlabel="max_queue_delay (ms; 0 drawn at 0.1)", ylabel="p99 (ms)",
           title="p99 against queue delay, per offered rate")
    names = [c["candidate"].replace(", preferred ", "\npref ") for c in summary]
    values = [c["objective_p99_ms"] if math.isfinite(c["objective_p99_ms"]) else 0.0 for c in summary]
    colors = ["tab:green" if c["picked"] else "tab:blue" if c["meets_slo"] else "tab:gray" for c in summary]
    a2.bar(range(len(names)), values, color=colors)
    a2.axhline(slo_ms, color="r", ls=":", label="SLO")
    a2.set_xticks(range(len(names)), names, rotation=60, fontsize=6)
    a2.set(yscale="log", ylabel="objective: worst p99 over the loads (ms)",
           title="objective per candidate (green: the pick; gray: misses the SLO)")
    for ax in (a1, a2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    return report.save_figure(fig, path, command, note)


def write(rows: list[dict], summary: list[dict], target: Target, a: Any, texts: Any, load0: Sequence[float],
          diff: str) -> list[Path]:
    pick = next((c for c in summary if c["picked"]), None)
    lines = curves.header(target, texts.seq_len, len(texts.texts), load0,
                          f"per candidate: a reload under {min(a.rates):g} req/s, then open-loop Poisson at "
                          f"{', '.join(f'{r:g}' for r in a.rates)} req/s ({a.warmup:g} s warm-up + {a.duration:g} s "
                          "each; latency from the scheduled send time)" + (
                              f", then Locust's tidal shape for {a.tidal_s:g} s peaking at {max(a.rates):g} req/s"
                              if a.tidal_s > 0 else ""))
    verdict = (f"**{pick['candidate']}**: worst p99 {pick['objective_p99_ms']:.1f} ms over the loads, "
               f"{pick['errors']} errors of {pick['sent']} requests" if pick else
               "**none meets the SLO**: lower the rates, raise --slo-p99-ms, or add capacity")
    lines += [f"SLO: p99 <= {a.slo_p99_ms:g} ms at every load, errors <= {a.max_error_rate:.0%} (a reload's "
              "included), every steady rate served (>= 90% of it answered in its window).", "",
              f"Pick: {verdict}." + (" Applied on the server (--apply)." if a.apply and pick else
                                     " The served config was loaded back as found." if not a.apply else ""),
              *([f"Written into `{a.write}/{target.encoder}/config.pbtxt`."] if a.write and pick else []), "",
              "## Candidates", "",
              *report.table("candidate | objective: worst p99 ms | requests | errors | of which in the reload | "
                            "rates served | SLO", [[c["candidate"], c["objective_p99_ms"], c["sent"], c["errors"],
                                                    c["reload_errors"], "yes" if c["served"] else "no",
                                                    "**picked**" if c["picked"] else "yes" if c["meets_slo"] else
                                                    "no"] for c in summary]),
              "", "![the grid](tune.png)", "", "![p50 and p99 against throughput](tune_curves.png)", ""]
    if diff:
        lines += ["## Config diff: served -> pick", "", "```diff", diff.rstrip(), "```", ""]
    lines += ["## Every load", "", *report.table(
        "candidate | load | req/s | p50 ms | p99 ms | batch | utilisation | errors",
        [[r["candidate"], r["load"] + (" (reload)" if r["kind"] == "reload" else ""), f"{r['throughput']:.1f}",
          r["p50_ms"], r["p99_ms"], r["avg_batch"], curves.util_text(r), r["errors"]] for r in rows])]
    steady = [r for r in rows if r["kind"] == "steady"]
    note = "open-loop Poisson; same texts on every curve"
    return [report.write_md(a.out / "tune.md", a.command, "Tune: queue delay and preferred sizes on a running Triton",
                            lines),
            report.write_csv(rows, FIELDS, a.out / "tune.csv", a.command),
            report.write_csv(summary, SUMMARY, a.out / "tune_candidates.csv", a.command),
            plot_grid(rows, summary, a.slo_p99_ms, a.out / "tune.png", a.command, note),
            curves.plot_curves(steady, "candidate", a.out / "tune_curves.png", a.command,
                               f"{target.encoder} at {target.url}", note,
                               highlight=pick["candidate"] if pick else None)]

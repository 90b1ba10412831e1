"""The reports of `bge-triton tune --url` and `tune pair --url`: every candidate at every load, the candidates'
objective, the pick and each model's config diff (STEM.md, STEM.csv, STEM_candidates.csv), the grid (STEM.png: p99
against delay per rate, or p99 per candidate per load; the objective per candidate, the pick) and the
latency-throughput curves (STEM_curves.png: p50 and p99 against throughput)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bge_triton.loadtest import curves, report
from bge_triton.loadtest.target import Target

LOAD_FIELDS = ("kind", "load", "rate", "sent", "throughput", "avg_ms", "p50_ms", "p99_ms", "n", "errors", "avg_batch",
               "gpu_util", "cpu_util", "first_error")
SUMMARY_FIELDS = ("objective_p99_ms", "sent", "errors", "reload_errors", "served", "meets_slo", "picked")


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
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=6)
    _objective_bars(a2, summary, slo_ms)
    return report.save_figure(fig, path, command, note)


@dataclass(frozen=True)
class Layout:
    """What a tuner's report is about: its file stem, title, the candidates' own columns, where the load went."""

    stem: str
    title: str
    fields: tuple[str, ...]  # the candidates' own columns (after "candidate")
    through: str  # how the load reached the server, for the report's windows line
    grid: str = "delay"  # the grid chart: "delay" (p99 against the queue delay) or "candidates" (p99 per candidate)
    shown: tuple[str, ...] = ()  # columns of the candidates' table besides the name


DELAY = Layout("tune", "Tune: queue delay and preferred sizes on a running Triton", ("delay_us", "preferred"),
               "tensor requests to the encoder")


def plot_candidates(rows: Sequence[dict], summary: Sequence[dict], slo_ms: float, path: Path, command: str,
                    note: str) -> Path:
    """Left: p99 per candidate, a line per offered load (steady rates and the tidal run), the pick shaded; right:
    each candidate's objective."""
    fig, (a1, a2) = report.subplots(2, 6.5, 4.8)
    names = [c["candidate"] for c in summary]
    for load in dict.fromkeys(r["load"] for r in rows if r["kind"] != "reload"):
        mine = {r["candidate"]: r["p99_ms"] for r in rows if r["load"] == load and r["kind"] != "reload" and r["n"]}
        a1.plot(range(len(names)), [mine.get(n, math.nan) for n in names], "o-" if "tidal" not in load else "s--",
                ms=3, label=load)
    for k, c in enumerate(summary):
        if c["picked"]:
            a1.axvspan(k - 0.4, k + 0.4, color="tab:green", alpha=0.2, label="the pick")
    a1.axhline(slo_ms, color="r", ls=":", label="SLO")
    a1.set_xticks(range(len(names)), [_wrap(n) for n in names], rotation=60, fontsize=6)
    a1.set(yscale="log", ylabel="p99 (ms)", title="p99 per candidate, a line per offered load")
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=6)
    _objective_bars(a2, summary, slo_ms)
    return report.save_figure(fig, path, command, note)


def _wrap(name: str) -> str:
    return name.replace(", preferred ", "\npref ").replace("; ", "\n")


def _objective_bars(ax: Any, summary: Sequence[dict], slo_ms: float) -> None:
    values = [c["objective_p99_ms"] if math.isfinite(c["objective_p99_ms"]) else 0.0 for c in summary]
    colors = ["tab:green" if c["picked"] else "tab:blue" if c["meets_slo"] else "tab:gray" for c in summary]
    ax.bar(range(len(summary)), values, color=colors)
    ax.axhline(slo_ms, color="r", ls=":", label="SLO")
    ax.set_xticks(range(len(summary)), [_wrap(c["candidate"]) for c in summary], rotation=60, fontsize=6)
    ax.set(yscale="log", ylabel="objective: worst p99 over the loads (ms)",
           title="objective per candidate (green: the pick; gray: misses the SLO)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)


def write(rows: list[dict], summary: list[dict], target: Target, a: Any, texts: Any, load0: Sequence[float],
          diff: str) -> list[Path]:
    """The report of `tune --url` (the encoder's batching)."""
    written = [a.write / target.encoder / "config.pbtxt"] if a.write and any(c["picked"] for c in summary) else []
    return write_report(rows, summary, target, a, texts, load0, [(target.encoder, diff)], DELAY, written)


def write_report(rows: list[dict], summary: list[dict], target: Target, a: Any, texts: Any, load0: Sequence[float],
                 diffs: Sequence[tuple[str, str]], layout: Layout, written: Sequence[Path] = (),
                 notes: Sequence[str] = ()) -> list[Path]:
    """A tuner's report: STEM.md (the pick, the candidates, each model's config diff, every load), STEM.csv,
    STEM_candidates.csv, STEM.png (the grid) and STEM_curves.png (p50 and p99 against throughput)."""
    pick = next((c for c in summary if c["picked"]), None)
    lines = curves.header(target, texts.seq_len, len(texts.texts), load0,
                          f"{layout.through}; per candidate: its reload under {min(a.rates):g} req/s, then open-loop "
                          f"Poisson at {', '.join(f'{r:g}' for r in a.rates)} req/s ({a.warmup:g} s warm-up + "
                          f"{a.duration:g} s each; latency from the scheduled send time)" + (
                              f", then Locust's tidal shape for {a.tidal_s:g} s peaking at {max(a.rates):g} req/s"
                              if a.tidal_s > 0 else ""))
    verdict = (f"**{pick['candidate']}**: worst p99 {pick['objective_p99_ms']:.1f} ms over the loads, "
               f"{pick['errors']} errors of {pick['sent']} requests" if pick else
               "**none meets the SLO**: lower the rates, raise --slo-p99-ms, or add capacity")
    lines += [f"SLO: p99 <= {a.slo_p99_ms:g} ms at every load, errors <= {a.max_error_rate:.0%} (a reload's "
              "included), every steady rate served (>= 90% of it answered in its window).", "",
              f"Pick: {verdict}." + (" Applied on the server (--apply)." if a.apply and pick else
                                     " The served config was loaded back as found." if not a.apply else ""),
              *([f"Written into {', '.join(f'`{w}`' for w in written)}."] if written else []), *notes, "",
              "## Candidates", "",
              *report.table(["candidate", *layout.shown, "objective: worst p99 ms", "requests", "errors",
                             "of which in the reload", "rates served", "SLO"],
                            [[c["candidate"], *(c[k] for k in layout.shown), c["objective_p99_ms"], c["sent"],
                              c["errors"], c["reload_errors"], "yes" if c["served"] else "no",
                              "**picked**" if c["picked"] else "yes" if c["meets_slo"] else "no"] for c in summary]),
              "", f"![the grid]({layout.stem}.png)", "", f"![p50 and p99 against throughput]({layout.stem}_curves.png)",
              ""]
    for model, diff in diffs:
        if diff:
            lines += [f"## Config diff of {model}: served -> pick", "", "```diff", diff.rstrip(), "```", ""]
    lines += ["## Every load", "", *report.table(
        "candidate | load | req/s | p50 ms | p99 ms | encoder batch | utilisation | errors",
        [[r["candidate"], r["load"] + (" (reload)" if r["kind"] == "reload" else ""), f"{r['throughput']:.1f}",
          r["p50_ms"], r["p99_ms"], r["avg_batch"], curves.util_text(r), r["errors"]] for r in rows])]
    steady = [r for r in rows if r["kind"] == "steady"]
    note = "open-loop Poisson; same texts on every curve"
    out, stem, cmd = a.out, layout.stem, a.command
    grid = plot_grid if layout.grid == "delay" else plot_candidates
    return [report.write_md(out / f"{stem}.md", cmd, layout.title, lines),
            report.write_csv(rows, ("candidate", *layout.fields, *LOAD_FIELDS), out / f"{stem}.csv", cmd),
            report.write_csv(summary, ("candidate", *layout.fields, *SUMMARY_FIELDS), out / f"{stem}_candidates.csv",
                             cmd),
            grid(rows, summary, a.slo_p99_ms, out / f"{stem}.png", cmd, note),
            curves.plot_curves(steady, "candidate", out / f"{stem}_curves.png", cmd,
                               f"{target.model if layout.grid != 'delay' else target.encoder} at {target.url}", note,
                               highlight=pick["candidate"] if pick else None)]

"""Stack benchmark report: markdown + CSV (+ PNG) from the measured rows; no measuring here."""
from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bge_triton.loadtest.stats import percentile

TARGET_RATIO = 0.92
TARGET_ADDED_P50_MS = 1.5
TARGET_PADDING = 1.15
PROTOTYPE = "a rough prototype measured 0.91 x and +0.8 ms on this machine"


@dataclass
class StackResults:
    """Everything one run measured; the report is a pure function of it."""

    header: dict[str, str]  # machine, command, model label, knobs (printed as a list)
    sweep: list[tuple[str, int, float]]  # (raw config label, batch, texts/s)
    rounds: list[dict[str, float]]  # per round: raw, stack, ratio, padding, batch, client_cores, errors
    # raw_on / raw_off / stack (/ stack_tritonclient, a reference), ms (all repeats)
    latency: dict[str, list[float]] = field(default_factory=dict)
    latency_repeats: list[dict[str, list[float]]] = field(default_factory=list)  # the same, one dict a repeat
    padding: dict[str, float] = field(default_factory=dict)  # stack, fifo, fifo_32, sorted_raw
    split: dict[str, float] = field(default_factory=dict)  # (c) in Triton: stats.phase_means_ms of its requests


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.3g}..{max(xs):.3g}" if xs else "-"


def _paired(a: list[float], b: list[float]) -> float:
    return percentile([x - y for x, y in zip(a, b, strict=False)], 50)


def _reference_row(res: StackResults, raw_key: str) -> dict[str, str]:
    """(c) through tritonclient's sync gRPC client, timed in the same blocks: no target, a reference."""
    lat = res.latency
    reps = [percentile(r.get("stack_tritonclient", []), 50) - percentile(r.get(raw_key, []),
                                                                         50) for r in res.latency_repeats]
    return {"row": "(c) the same stack through tritonclient's sync gRPC client, p50 / added p50",
            "value": f"{percentile(lat['stack_tritonclient'], 50):.2f} ms / {statistics.median(reps):+.2f} ms",
            "noise": f"repeats {_spread(reps)}; same blocks as the row above", "target": "-", "verdict": "-"}


def summary_rows(res: StackResults) -> list[dict[str, str]]:
    """The headline table: metric, measured (median over rounds), noise, target, verdict."""
    raw = [r["raw"] for r in res.rounds]
    stack = [r["stack"] for r in res.rounds]
    ratio = [r["ratio"] for r in res.rounds]
    lat = res.latency
    raw_key = min(("raw_on", "raw_off"), key=lambda k: percentile(lat.get(k, []), 50))
    raw_p50, raw_p99 = percentile(lat.get(raw_key, []), 50), percentile(lat.get(raw_key, []), 99)
    st_p50, st_p99 = percentile(lat.get("stack", []), 50), percentile(lat.get("stack", []), 99)
    med_ratio = statistics.median(ratio) if ratio else float("nan")
    added = st_p50 - raw_p50
    reps = [percentile(r.get("stack", []), 50) - percentile(r.get(raw_key, []), 50) for r in res.latency_repeats]
    if reps:  # the headline is the median over whole repeats; their spread is the noise
        added = statistics.median(reps)
    pad = res.padding

    def ok(good: bool) -> str:
        return "PASS" if good else "MISS"

    return [
        {"row": "(a) raw ONNX Runtime, best batch", "value": f"{statistics.median(raw):.1f} texts/s",
         "noise": f"rounds {_spread(raw)}", "target": "-", "verdict": "-"},
        {"row": "(b) full stack at saturation", "value": f"{statistics.median(stack):.1f} texts/s",
         "noise": f"rounds {_spread(stack)}", "target": "-", "verdict": "-"},
        {"row": "(b)/(a), per round then median", "value": f"{med_ratio:.3f}",
         "noise": f"rounds {_spread(ratio)}", "target": f">= {TARGET_RATIO}", "verdict": ok(med_ratio >= TARGET_RATIO)},
        {"row": "(c) raw batch-1 latency p50 / p99", "value": f"{raw_p50:.2f} / {raw_p99:.2f} ms",
         "noise": f"n={len(lat.get(raw_key, []))}, {raw_key.replace('raw_', 'spin ')}", "target": "-", "verdict": "-"},
        {"row": "(c) full stack, 1 in flight, p50 / p99", "value": f"{st_p50:.2f} / {st_p99:.2f} ms",
         "noise": f"n={len(lat.get('stack', []))}", "target": "-", "verdict": "-"},
        {"row": "(c) raw batch-1 p50, spin off / spin on", "value": f"{percentile(lat.get('raw_off', []), 50):.2f} / "
                                                                      f"{percentile(lat.get('raw_on', []), 50):.2f} ms",
         "noise": "the faster one is the reference", "target": "-", "verdict": "-"},
        {"row": "(c) added p50 (stack - raw)" + (f", median of {len(reps)} repeats" if reps else ""),
         "value": f"{added:+.2f} ms",
         "noise": (f"repeats {_spread(reps)}; " if reps else "")
                  + f"median of per-text differences {_paired(lat.get('stack', []), lat.get(raw_key, [])):+.2f} ms",
         "target": f"<= +{TARGET_ADDED_P50_MS} ms", "verdict": ok(added <= TARGET_ADDED_P50_MS)},
        *([] if not lat.get("stack_tritonclient") else [_reference_row(res, raw_key)]),
        {"row": "padding ratio of (b) (kit metrics)", "value": f"{pad.get('stack', float('nan')):.3f}",
         "noise": f"rounds {_spread([r['padding'] for r in res.rounds])}", "target": f"<= {TARGET_PADDING}",
         "verdict": ok(pad.get("stack", 9.0) <= TARGET_PADDING)},
        {"row": f"padding ratio, FIFO pad-to-longest (B={pad.get('fifo_batch', 0):.0f}, same traffic)",
         "value": f"{pad.get('fifo', float('nan')):.3f}", "noise": "computed", "target": "-", "verdict": "-"},
        {"row": "padding ratio, FIFO pad-to-longest (B=32)", "value": f"{pad.get('fifo_32', float('nan')):.3f}",
         "noise": "computed", "target": "-", "verdict": "-"},
    ]


SPLIT_PHASES = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def split_table(res: StackResults) -> list[str]:
    """(c)'s mean by Triton's statistics: in Triton (arrival to response, by phase) and outside it, per client."""
    if not res.split:
        return []
    inside = res.split["success"]
    out = ["", "## Where (c)'s time goes (Triton's statistics, means per request)", "",
           "In Triton: from a request's arrival in the core to its response (queue + compute input / infer / "
           "output, as the server counts them, over every (c) request to the text endpoint). Outside Triton: "
           "a client's mean minus that (frontend, loopback, client library).", "",
           "| client | client mean ms | in Triton ms | queue | compute input | compute infer | compute output "
           "| outside Triton ms |", "|---|---|---|---|---|---|---|---|"]
    for key in ("stack", "stack_tritonclient"):
        xs = res.latency.get(key)
        if xs:
            mean = statistics.fmean(xs)
            phases = " | ".join(f"{res.split[p]:.2f}" for p in SPLIT_PHASES[1:])
            out.append(f"| {key} | {mean:.2f} | {inside:.2f} | {phases} | {mean - inside:.2f} |")
    return out


def write_report(res: StackResults, out: Path, command: str) -> list[Path]:
    """Write stack_bench.md, stack_bench.csv and stack_bench.png (when matplotlib is there)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(res)
    csv_path = out / "stack_bench.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as fh:
        fh.write(f"# Generated by `{command}`; rerun it to regenerate. Model is SYNTHETIC.\n")
        w = csv.writer(fh)
        w.writerow(["section", "name", "value", "noise", "target", "verdict"])
        for r in rows:
            w.writerow(["summary", r["row"], r["value"], r["noise"], r["target"], r["verdict"]])
        for label, _batch, tps in res.sweep:
            w.writerow(["raw_sweep", label, f"{tps:.2f}", "", "", ""])
        for i, one_round in enumerate(res.rounds):
            for key, val in one_round.items():
                w.writerow([f"round_{i + 1}", key, f"{val:.4f}", "", "", ""])
    md = [f"<!-- Generated by `{command}`; rerun it to regenerate. -->",
          "# Stack benchmark: raw ONNX Runtime vs the full Triton stack (text endpoint)", "",
          "**The model is SYNTHETIC** (random weights, exact bge-small-zh architecture): speed only, the "
          "vectors mean nothing.", ""]
    md += [f"- **{k}**: {v}" for k, v in res.header.items()]
    md += ["", "| measurement | value | noise | target | verdict |", "|---|---|---|---|---|"]
    md += [f"| {r['row']} | {r['value']} | {r['noise']} | {r['target']} | {r['verdict']} |" for r in rows]
    md += split_table(res)
    md += ["", f"Reference: {PROTOTYPE}.", "", "## Raw ONNX Runtime sweep (picks (a)'s configuration)", "",
           "| raw configuration | texts/s |", "|---|---|"]
    md += [f"| {label} | {tps:.1f} |" for label, _, tps in res.sweep]
    md += ["", "## Rounds ((a) and (b) back to back, order alternating)", "",
           "| round | (a) texts/s | (b) texts/s | (b)/(a) | padding (b) | texts per Triton batch | "
           "client cores | errors |", "|---|---|---|---|---|---|---|---|"]
    md += [f"| {i + 1} | {r['raw']:.1f} | {r['stack']:.1f} | {r['ratio']:.3f} | {r['padding']:.3f} | "
           f"{r['batch']:.1f} | {r['client_cores']:.2f} | {r['errors']:.0f} |" for i, r in enumerate(res.rounds)]
    paths = [csv_path]
    png = _plot(res, out / "stack_bench.png")
    if png:
        md += ["", f"![raw sweep and stack]({png.name})"]
        paths.append(png)
    md_path = out / "stack_bench.md"
    md_path.write_text("\n".join(md) + "\n", encoding="utf-8")
    return [md_path, *paths]


def _plot(res: StackResults, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for spin in ("on", "off"):
        for order in ("sorted", "shuffled"):
            pts = sorted((b, t) for label, b, t in res.sweep if f"spin {spin}" in label and label.endswith(order))
            if pts:
                ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                         ls="-" if order == "sorted" else ":", label=f"raw ORT, spin {spin}, {order}")
    stack = [r["stack"] for r in res.rounds]
    if stack:
        ax1.axhline(statistics.median(stack), color="k", ls="--", label="full stack (b), median")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("raw batch size")
    ax1.set_ylabel("texts/s")
    ax1.set_title("throughput (SYNTHETIC bge-small-zh)")
    ax1.legend(fontsize=8)
    for key, label in (("raw_on", "raw batch 1, spin on"), ("raw_off", "raw batch 1, spin off"),
                       ("stack", "stack, 1 in flight"), ("stack_tritonclient", "stack via tritonclient gRPC")):
        xs = sorted(res.latency.get(key, []))
        if xs:
            ax2.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("CDF")
    ax2.set_title("one request in flight")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

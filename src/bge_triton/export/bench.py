"""`python -m bge_triton.export.bench`: raw ONNX Runtime latency/throughput of the exported graphs, no server.

Synthetic bge-large-zh and bge-small-zh (real shapes, random weights) at fp32, int8 recipes and fp16 where the CPU
runs it; batch 1/8/32 x sequence 32/128. Writes reports/export/bench.md + bench.csv. CPU numbers are ratios
against fp32 measured in the same run, not goals.
"""
from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bge_triton.errors import ExportError
from bge_triton.loadtest import report
from bge_triton.loadtest.turns import take_turns

from .validate import OnnxEmbedder
from .variants import VariantBuilder


@dataclass(frozen=True)
class BenchSettings:
    """One benchmark run, from flags."""

    models: tuple[str, ...]
    precisions: tuple[str, ...]  # fp32, fp16, int8-<recipe>
    batches: tuple[int, ...]
    seqs: tuple[int, ...]
    reps: int
    threads: int
    out: Path
    cache_dir: Path
    quick: bool


def parse(argv: Sequence[str] | None = None) -> BenchSettings:
    """Flags -> BenchSettings (--quick: batch 1/8, 3 repetitions)."""
    p = argparse.ArgumentParser(prog="python -m bge_triton.export.bench", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="synthetic:bge-large-zh,synthetic:bge-small-zh",
                   help="comma-separated --model values")
    p.add_argument("--precisions", default="fp32,int8-nbits8,int8-plain,fp16",
                   help="comma-separated: fp32, fp16, int8-<recipe> (recipes: export.optimize.RECIPES)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--seqs", default="32,128")
    p.add_argument("--reps", type=int, default=5, help="timed runs per cell (median reported)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = all cores)")
    p.add_argument("--out", type=Path, default=Path("reports/export"))
    p.add_argument("--cache-dir", type=Path, default=Path(".kit/cache"))
    p.add_argument("--quick", action="store_true", help="batch 1 and 8 only, 3 repetitions (a few minutes)")
    a = p.parse_args(argv)
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    return BenchSettings(models=tuple(a.models.split(",")), precisions=tuple(a.precisions.split(",")),
                         batches=(1, 8) if a.quick else ints(a.batches), seqs=ints(a.seqs),
                         reps=3 if a.quick else a.reps, threads=a.threads, out=a.out, cache_dir=a.cache_dir,
                         quick=a.quick)


def feeds_for(batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """Random token ids ([CLS] first) with a full attention mask."""
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(1000, vocab, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, seq), np.int64)}
    feeds["input_ids"][:, 0] = 101
    return feeds


def time_round_robin(sessions: dict[str, OnnxEmbedder], batch: int, seq: int, reps: int,
                     vocab: int) -> dict[str, list[float]]:
    """Seconds per run of each session on one shape, timed in turns (ABBA) so outside load hits every session alike."""
    feeds = feeds_for(batch, seq, vocab)
    for emb in sessions.values():
        emb(feeds)  # warm-up

    def timed(_round: int, name: str) -> float:
        t = time.perf_counter()
        sessions[name](feeds)
        return time.perf_counter() - t

    return take_turns(list(sessions), reps, timed)[0]


def run(s: BenchSettings) -> list[dict]:
    """Measure every (model, precision, batch, seq) cell; a precision the CPU cannot run is recorded as such.

    Precisions of one model are timed round-robin within each cell, so load from other processes hits them alike.
    """
    rows: list[dict] = []
    cells = len(s.models) * len(s.precisions) * len(s.batches) * len(s.seqs)
    bar = tqdm(total=cells, desc="bench", unit="cell")
    for model in s.models:
        vb = VariantBuilder(model, s.cache_dir)
        vocab = 21128 if model.startswith("synthetic:") else 30000
        sessions: dict[str, OnnxEmbedder] = {}
        for prec in s.precisions:
            base, _, recipe = prec.partition("-")
            try:
                sessions[prec] = OnnxEmbedder(vb.variant(base, recipe or "nbits8"), s.threads)
            except ExportError as err:
                rows += [{"model": model, "precision": prec, "batch": b, "seq": q, "error": str(err)[:120]}
                         for b in s.batches for q in s.seqs]
                bar.update(len(s.batches) * len(s.seqs))
        for b in s.batches:
            for q in s.seqs:
                for prec, t in time_round_robin(sessions, b, q, s.reps, vocab).items():
                    med = float(np.median(t))
                    rows.append({"model": model, "precision": prec, "batch": b, "seq": q, "p50_ms": med * 1e3,
                                 "max_ms": max(t) * 1e3, "texts_per_s": b / med, "reps": s.reps})
                    bar.update(1)
        sessions.clear()
    bar.close()
    order = {m: i for i, m in enumerate(s.models)}, {p: i for i, p in enumerate(s.precisions)}
    rows.sort(key=lambda r: (order[0][r["model"]], order[1][r["precision"]], r["batch"], r["seq"]))
    for r in rows:  # speed-up against fp32 of the same model and shape, measured in this run
        ref = next((x for x in rows if x["model"] == r["model"] and x["precision"] == "fp32"
                    and x["batch"] == r["batch"]
                    and x["seq"] == r["seq"] and "p50_ms" in x), None)
        if ref and "p50_ms" in r:
            r["speedup_vs_fp32"] = ref["p50_ms"] / r["p50_ms"]
    return rows


def write(rows: list[dict], s: BenchSettings, cmd: str, machine: dict[str, Any]) -> tuple[Path, Path]:
    """bench.csv and bench.md under s.out."""
    s.out.mkdir(parents=True, exist_ok=True)
    cols = ["model", "precision", "batch", "seq", "p50_ms", "max_ms", "texts_per_s", "speedup_vs_fp32", "reps", "error"]
    csv_path, md_path = s.out / "bench.csv", s.out / "bench.md"
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()})
    lines = [f"<!-- Generated by `{cmd}`; rerun that command to regenerate. -->",
             "# Raw ONNX Runtime speed of the exported encoder (SYNTHETIC weights, real shapes)", "",
             *report.header(machine, server=None, command=cmd),
             "ONNX Runtime CPU execution provider, full attention masks, random token ids. "
             "Synthetic models have the exact architecture, so timings transfer; their vectors mean nothing. "
             "Precisions are timed round-robin within each cell; compare ratios within one run: other processes on a "
             "shared machine move absolute times.", "",
             "| model | precision | batch | seq | p50 ms | max ms | texts/s | speed-up vs fp32 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['seq']} | "
                         f"not runnable: {r['error']} | | | |")
            continue
        sp = f"{r['speedup_vs_fp32']:.2f}x" if "speedup_vs_fp32" in r else "-"
        lines.append(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['seq']} | {r['p50_ms']:.1f} | "
                     f"{r['max_ms']:.1f} | {r['texts_per_s']:.1f} | {sp} |")
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md_path, csv_path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the markdown table."""
    import sys

    s = parse(argv)
    machine = report.machine_info()
    cmd = "python -m bge_triton.export.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        rows = run(s)
    except ExportError as err:
        print(f"bench failed: {err}", file=sys.stderr)
        return 1
    md, _ = write(rows, s, cmd.strip(), machine)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

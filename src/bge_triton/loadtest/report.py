"""The one report writer of every benchmark: markdown + CSV + PNG, tables as data, each naming its command.
Stdlib only at import (the bare GPU host imports it); matplotlib is imported by the plotting functions."""
from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SERVER = "tritonserver 2.51 (nvidia-pytriton 0.7.0 wheel)"


def load_average() -> tuple[float, float, float]:
    """The 1 / 5 / 15 min load average now (NaN where the platform has none)."""
    return os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """THE machine description, taken when a run starts: CPU, cores, Python, the load average (`load`), the server;
    on `cuda` the GPU, CUDA, torch, driver."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor() or platform.machine())
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                            "load": load_average(), "server": f"{SERVER}, python backend",
                            "platform": platform.platform()}
    if device.startswith("cuda"):
        import torch

        idx = torch.device(device).index or 0
        info.update(gpu=torch.cuda.get_device_name(idx), cuda=str(torch.version.cuda), torch=torch.__version__)
        if exe := shutil.which("nvidia-smi"):
            info["driver, memory"] = subprocess.run(
                [exe, "--query-gpu=driver_version,memory.total", "--format=csv,noheader", f"--id={idx}"],
                capture_output=True, text=True, timeout=30).stdout.strip()
    return info


MACHINE_KEYS = ("cpu", "cores", "python", "load", "server", "platform", "gpu", "cuda", "torch", "driver, memory")


def _load_text(load: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def header(machine: Mapping[str, Any] | None = None, *, load_start: Sequence[float] | None = None,
           server: str | None = "", label: str = "Machine", extra: Mapping[str, Any] | None = None,
           command: str | None = None) -> list[str]:
    """THE report header, the same lines in every benchmark report: the command (when given: `write_md` writes it
    itself), the machine (`machine_info()` taken at the start; CPU, cores, OS, Python, GPU or none, the server: its
    `SERVER` by default, None leaves it out), the load average at the start (`load_start`, else the machine's) and
    now, the date; then one `key: value` line per `extra`. Markdown lines (two trailing spaces), a blank line last."""
    m = machine_info() if machine is None else machine
    gpu = (f"GPU {m['gpu']}" + "".join(f", {k} {m[k]}" for k in ("cuda", "torch", "driver, memory") if m.get(k))
           if m.get("gpu") else "no GPU")
    srv = m.get("server", f"{SERVER}, python backend") if server == "" else server
    start = load_start if load_start is not None else m.get("load", (math.nan,) * 3)
    when = datetime.datetime.now(datetime.timezone.utc)
    return [*([f"Command: `{command}`  "] if command else []),
            f"{label}: {m.get('cores', '?')} CPU cores ({m.get('cpu', '?')}), {m.get('platform', platform.platform())},"
            f" Python {m.get('python', platform.python_version())}, {gpu}" + (f"; server {srv}" if srv else "") + ".  ",
            f"Load average at start {_load_text(start)}, at the end {_load_text(load_average())} (1 / 5 / 15 min; "
            "other jobs on this machine move absolute times: compare rows of one run).  ",
            f"Date: {when:%Y-%m-%d %H:%M} UTC.  ", *(f"{k}: {v}  " for k, v in (extra or {}).items()), ""]


def header_text(machine: Mapping[str, Any] | None = None, **kw: Any) -> str:
    """`header` as one line (a CSV's comment, a console line)."""
    return " ".join(line.strip() for line in header(machine, **kw) if line.strip())


def fmt(value: float | None, digits: int = 1) -> str:
    """A table cell: the value to `digits` decimals, "-" for a missing or NaN one."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def row_line(row: Mapping[str, Any]) -> str:
    """One console line per measurement (the rows of loadtest.core.measure)."""
    return (f"{row['executor']:11s} {row['scenario']:13s} {row['phase']:4s} {row['load']:>8s}: "
            f"{row['throughput']:7.1f} req/s  avg {fmt(row['avg_ms'])}  p50 {fmt(row['p50_ms'])}  p99 "
            f"{fmt(row['p99_ms'])} ms  batch {fmt(row['avg_batch'])}  queue {fmt(row['queue_ms'])}  compute "
            f"{fmt(row['compute_ms'])} ms  cpu {fmt(row['cpu_pct'], 0)}%  err {row['errors']}")


def write_csv(rows: Sequence[Mapping[str, Any]], fields: Sequence[str], path: Path, command: str,
              digits: int = 3) -> Path:
    """THE CSV writer: a `# generated by` line, then `fields` of each row (floats to `digits` decimals, None "-")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(f"# generated by `{command}`\n")
        w = csv.DictWriter(fh, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.{digits}f}" if isinstance(v, float) else "-" if v is None else v)
                        for k, v in row.items()})
    return path


def table(header: str | Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table: header 'a | b' (or its names), a sequence of cells per row (floats to 1 decimal, None "-")."""
    header = header if isinstance(header, str) else " | ".join(header)
    return [f"| {header} |", "|" + "---|" * len(header.split(" | ")),
            *("| " + " | ".join(fmt(v) if isinstance(v, float) or v is None else str(v) for v in row) + " |"
              for row in rows)]


def write_md(path: Path, command: str, title: str, lines: Sequence[str]) -> Path:
    """A report page: the generated-by line, the title, the command, then `lines`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = [f"<!-- generated by `{command}`; rerun it to regenerate -->", f"# {title}", "", f"Command: `{command}`  "]
    path.write_text("\n".join([*head, *lines, ""]), encoding="utf-8")
    return path


def subplots(n: int, width: float = 6.5, height: float = 4.8) -> tuple[Any, list[Any]]:
    """A figure of n panels side by side (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig: Any, path: Path, command: str, note: str = "") -> Path:
    """Footer naming the command (and `note`), then the PNG, its metadata naming the command too."""
    import matplotlib.pyplot as plt

    fig.text(0.01, 0.01, f"generated by `{command}`" + (f"; {note}" if note else ""), fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Description": f"generated by `{command}`"})
    plt.close(fig)
    return path


def plot_p99(rows: Sequence[Mapping[str, Any]], path: Path, command: str, titles: Mapping[str, str],
             machine: str = "2-core shared CPU", marks: Mapping[str, tuple[list, list, str]] | None = None) -> Path:
    """p99 latency vs throughput per scenario, one panel per executor (`marks`: extra (xs, ys, label) per panel)."""
    executors = sorted({r["executor"] for r in rows})
    fig, axes = subplots(len(executors))
    for ax, ex in zip(axes, executors, strict=True):
        for sc in dict.fromkeys(r["scenario"] for r in rows if r["executor"] == ex):
            pts = sorted((r["throughput"], r["p99_ms"]) for r in rows if r["executor"] == ex and r["scenario"] == sc)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=sc)
        if marks and ex in marks:
            ax.scatter(*marks[ex][:2], marker="x", color="k", label=marks[ex][2])
        ax.set(yscale="log", xlabel="throughput (req/s)", ylabel="p99 latency (ms)", title=titles.get(ex, ex))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, command, machine)

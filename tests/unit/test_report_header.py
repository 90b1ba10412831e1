"""The one report header (loadtest/report.py `header`): its lines, and no other report writer formatting its own."""
from __future__ import annotations

import ast
import math
import re
from pathlib import Path

from bge_triton.loadtest import report

ROOT = Path(__file__).resolve().parents[2]
WRITERS = [*sorted((ROOT / "src/bge_triton/loadtest").rglob("*.py")),
           *sorted((ROOT / "src/bge_triton/export").glob("*.py")), ROOT / "deploy/k8s/capacity.py"]
OWN_HEADER = re.compile(r"Machine:|(?i:load average)|loadavg_at_start|machine_line")


def test_header_names_machine_load_at_start_and_end_date_and_extras() -> None:
    machine = {**report.machine_info(), "load": (1.0, 0.5, 0.25)}
    lines = report.header(machine, extra={"Texts": "512 reviews"}, command="bge-triton bench x")
    assert lines[0] == "Command: `bge-triton bench x`  " and lines[-1] == ""
    assert lines[1].startswith(f"Machine: {machine['cores']} CPU cores (") and "no GPU; server tritonserver" in lines[1]
    assert re.fullmatch(r"Load average at start 1\.00 / 0\.50 / 0\.25, at the end [\d.]+ / [\d.]+ / [\d.]+ .*  ",
                        lines[2])
    assert re.fullmatch(r"Date: \d{4}-\d\d-\d\d \d\d:\d\d UTC\.  ", lines[3]) and lines[4] == "Texts: 512 reviews  "


def test_header_of_a_gpu_host_without_the_server_and_with_a_given_start_load() -> None:
    machine = {"cores": 16, "cpu": "Xeon", "platform": "Linux", "python": "3.11", "gpu": "NVIDIA H100", "cuda": "12.4",
               "load": (9.0, 9.0, 9.0)}
    lines = report.header(machine, load_start=(math.nan, 2.0, 3.0), server=None, label="Load generator")
    assert lines[0] == "Load generator: 16 CPU cores (Xeon), Linux, Python 3.11, GPU NVIDIA H100, cuda 12.4.  "
    assert lines[1].startswith("Load average at start nan / 2.00 / 3.00, at the end ")
    assert report.header_text(machine).startswith("Machine: 16 CPU cores (Xeon)") and "\n" not in report.header_text()


def test_no_report_writer_formats_its_own_machine_or_load_line() -> None:
    """Every benchmark report takes its machine and load lines from report.header (one format, start and end load)."""
    own = []
    for path in WRITERS:
        if path.name == "report.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and OWN_HEADER.search(node.value):
                own.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not own, "format these through loadtest.report.header:\n" + "\n".join(own)

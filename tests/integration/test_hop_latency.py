"""`python -m bge_triton.loadtest.hop_latency` runs on the real local Triton and reports all three hops."""
from __future__ import annotations

from pathlib import Path

from bge_triton.loadtest.hop_latency import main

PATHS = ["encoder through Triton (gRPC + python stub)",
         "text endpoint, in-process encoder (CPU default: + tokenize)",
         "text endpoint, BLS to the encoder (GPU topology: + tokenize + stub hop)"]
NOOP = ["no-op python model, answered at once",
        "no-op python model, stub busy 8 ms first (busy time subtracted)"]


def _tables(report: str) -> list[list[list[str]]]:
    """The report's markdown tables: rows of cells, header and separator dropped."""
    tables, current = [], None
    for line in report.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if current is None:
                current = []
                tables.append(current)
            elif not set("".join(cells)) <= {"-"}:
                current.append(cells)
        else:
            current = None
    return tables


def test_hop_latency_reports_every_hop(minilm_repo: Path, tmp_path: Path) -> None:
    assert main(["--repository", str(minilm_repo), "--name", "minilm", "-n", "5", "--out", str(tmp_path)]) == 0
    hops, trips, split = _tables((tmp_path / "hops_spin_on.md").read_text())
    assert [row[0] for row in hops] == PATHS
    assert [row[0] for row in trips] == NOOP
    for row in trips:
        assert float(row[1]) > 0  # a round trip beyond the busy time is never free
    assert [row[0] for row in split] == PATHS + NOOP
    for name, raw, client, triton, queue, c_in, c_infer, c_out, outside in split:
        assert (raw == "-") == (name in NOOP)
        # Triton's statistics cover part of what the client timed; the parts are its own sub-durations
        assert 0 < float(triton) < float(client) and float(outside) > 0
        assert float(queue) + float(c_in) + float(c_infer) + float(c_out) <= float(triton) + 0.02
        assert min(float(queue), float(c_in), float(c_out)) >= 0

"""`python -m loadtest.hop_latency` runs on the real local Triton and reports all three hops."""
from __future__ import annotations

from pathlib import Path

from loadtest.hop_latency import main


def test_hop_latency_reports_every_hop(minilm_repo: Path, tmp_path: Path) -> None:
    assert main(["--repository", str(minilm_repo), "--name", "minilm", "-n", "5", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "hops_spin_on.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "ms" not in line.split("|")[2]]
    names = [line.split("|")[1].strip() for line in rows]
    assert names == ["encoder through Triton (gRPC + python stub)",
                     "text endpoint, in-process encoder (CPU default: + tokenize)",
                     "text endpoint, BLS to the encoder (GPU topology: + tokenize + stub hop)",
                     "no-op python model, answered at once",
                     "no-op python model, stub busy 8 ms first (busy time subtracted)"]
    for line in rows:
        assert float(line.split("|")[2]) > 0  # a round trip beyond the busy time is never free

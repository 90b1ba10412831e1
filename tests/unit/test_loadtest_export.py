"""harness.export: the one place the benches run the kit's exporter (bench seed/shipped, stack, chaos)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bge_triton.errors import ExportError
from bge_triton.loadtest import harness


def _fake_run(calls: list[list[str]], writes: bool, rc: int):
    def run(cmd: list[str], *args, **kwargs) -> subprocess.CompletedProcess:
        calls.append(cmd)
        if writes:
            repo = Path(cmd[cmd.index("--repository") + 1])
            onnx = repo / f"{cmd[cmd.index('--model') + 1]}_onnx" / "1" / "model.onnx"
            onnx.parent.mkdir(parents=True)
            onnx.write_bytes(b"onnx")
        return subprocess.CompletedProcess(cmd, rc)
    return run


def test_exports_once_then_reuses_the_export(tmp_path, monkeypatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(harness.subprocess, "run", _fake_run(calls, writes=True, rc=0))
    first = harness.export("synthetic:bge-small-zh", tmp_path, "m", "fp16", "--max-length", "256")
    second = harness.export("synthetic:bge-small-zh", tmp_path, "m", "fp16")
    assert first == second == tmp_path / "m_onnx" / "1" / "model.onnx"
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:3] == ["-m", "bge_triton.export"]
    assert cmd[cmd.index("--precision") + 1] == "fp16" and cmd[-2:] == ["--max-length", "256"]


@pytest.mark.parametrize(("writes", "rc"), [(False, 1), (False, 0)], ids=["exporter failed", "no onnx written"])
def test_a_failed_export_names_the_command_to_rerun(tmp_path, monkeypatch, writes: bool, rc: int) -> None:
    monkeypatch.setattr(harness.subprocess, "run", _fake_run([], writes=writes, rc=rc))
    with pytest.raises(ExportError, match=r"run it by hand to see why: .*-m bge_triton.export --model-id m1 "):
        harness.export("m1", tmp_path, "m")

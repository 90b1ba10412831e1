"""The reranker export end to end (synthetic:bge-reranker-small, the exact layout of bge-reranker-large): FP16 and
the INT8 recipe the 24.10 server's ONNX Runtime 1.19.2 runs, loaded in that ONNX Runtime and held to the PyTorch
scores of the reference pairs; the kind comes from the config and --task forces it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bge_triton.export.compat import ensure_venv
from bge_triton.export.recipes import SERVER_IMAGE_ORT
from bge_triton.repository import load_repository
from conftest import REPO_ROOT, run_export

pytestmark = pytest.mark.integration
RUNNER = r"""
import json, sys
import numpy as np
import onnxruntime as ort
job = json.load(sys.stdin)
s = ort.InferenceSession(job["model"], providers=["CPUExecutionProvider"])
names = {i.name for i in s.get_inputs()}
out = []
for p in job["pairs"]:
    a = np.asarray([p["input_ids"]], dtype=np.int64)
    feeds = {"input_ids": a, "attention_mask": np.ones_like(a)}
    if "token_type_ids" in names:
        feeds["token_type_ids"] = np.asarray([p["token_type_ids"]], dtype=np.int64)
    out.append(float(s.run(["score"], feeds)[0][0, 0]))
json.dump({"onnxruntime": ort.__version__, "scores": out}, sys.stdout)
"""


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerank_export")
    out = {}
    for precision in ("fp16", "int8"):
        repo = root / precision
        run_export(repo, "rr", "synthetic:bge-reranker-small", precision, "--max-length", "128", "--cache-dir",
                   str(root / "cache"))
        out[precision] = repo
    return out


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_export_writes_a_validated_reranker_with_its_reference(exports, precision) -> None:
    repo = exports[precision]
    report = json.loads((repo / "rr_onnx" / "1" / "export_report.json").read_text())
    assert report["task"] == "rerank" and report["synthetic"] and report["fidelity"]["passed"]
    assert report["architectures"] == ["XLMRobertaForSequenceClassification"] and report["token_types"] is False
    assert list(report["inputs"]) == ["input_ids", "attention_mask"]
    assert report["outputs"] == {"score": {"dtype": "FLOAT", "shape": ["batch_size", 1]}}
    if precision == "int8":
        assert report["conversion"]["int8"]["name"] == "qdq8"  # what 1.19.2 runs
    configs = load_repository(repo)
    assert set(configs) == {"rr", "rr_onnx"} and configs["rr"].parameters["onnx_model"].string_value == "rr_onnx"
    ref = json.loads((repo / "rr_onnx" / "1" / "reference.json").read_text())
    assert ref["format"] == "bge-triton-rerank-reference/1" and len(ref["pairs"]) == 24
    assert {f.name for f in (repo / "rr" / "1").iterdir()} >= {"model.py", "rerank_stages.py", "text_model.py",
                                                               "text_core.py", "text_scheduler.py", "tokenizer"}
    assert not any(f.is_symlink() for f in (repo / "rr" / "1").iterdir())  # copies: the repository stands alone


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_the_graphs_run_in_the_server_images_onnxruntime(exports, precision) -> None:
    python = ensure_venv(SERVER_IMAGE_ORT, REPO_ROOT / ".kit" / "venvs")
    repo = exports[precision]
    ref = json.loads((repo / "rr_onnx" / "1" / "reference.json").read_text())
    proc = subprocess.run([str(python), "-c", RUNNER], capture_output=True, text=True, timeout=600,
                          input=json.dumps({"model": str(repo / "rr_onnx" / "1" / "model.onnx"),
                                            "pairs": ref["pairs"]}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["onnxruntime"] == SERVER_IMAGE_ORT
    diff = np.abs(np.array(out["scores"]) - np.array([p["score"] for p in ref["pairs"]])).max()
    assert diff <= ref["tolerance"]["max_abs"], (diff, ref["tolerance"])


def test_task_flag_forces_the_kind_and_refuses_a_head_that_is_not_there(tmp_path) -> None:
    cmd = [sys.executable, "-m", "bge_triton.export", "--model", "synthetic:bge-small-zh", "--repository",
           str(tmp_path / "r"), "--name", "m", "--precision", "fp32", "--task", "rerank", "--quiet",
           "--cache-dir", str(tmp_path / "c")]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "needs a sequence-classification head" in proc.stderr
    assert not (tmp_path / "r").exists()
    trunk = tmp_path / "trunk"
    run_export(trunk, "emb", "synthetic:bge-reranker-small", "fp32", "--task", "embed", "--max-length", "64",
               "--cache-dir", str(tmp_path / "c"))
    report = json.loads((trunk / "emb_onnx" / "1" / "export_report.json").read_text())
    assert "task" not in report and list(report["outputs"]) == ["embedding"]  # the trunk as an embedder

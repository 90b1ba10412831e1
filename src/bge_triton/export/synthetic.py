"""Synthetic BGE models: the exact BERT architecture with seeded random weights and a generated Chinese vocab.

For speed work without the hub: shapes, FLOPs and tokenisation match the real model, the vectors mean nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bge_triton.errors import ExportError

VOCAB_SIZE = 21128
# BERT's special tokens keep their ids, as in bert-base-chinese (1..99 are [unusedN]).
SPECIAL_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
CJK_PUNCT = "，。！？、；：“”‘’（）《》【】…"
CJK_FIRST = 0x4E00
MARKER_FILE = "synthetic.json"


@dataclass(frozen=True)
class Arch:
    """BERT dimensions of one BGE model."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    positions: int = 512
    vocab: int = VOCAB_SIZE


# bge-large-zh-v1.5 and bge-small-zh-v1.5 (both BertModel, CLS pooling, L2 normalised).
ARCHS: dict[str, Arch] = {
    "bge-large-zh": Arch(layers=24, hidden=1024, heads=16, intermediate=4096),
    "bge-small-zh": Arch(layers=4, hidden=512, heads=8, intermediate=2048),
}


def build_vocab() -> list[str]:
    """21128 WordPiece entries: specials at BERT's ids, ASCII, ##-pieces, CJK punctuation, CJK ideographs from
    U+4E00."""
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ascii_chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]  # lower-cased tokenizer: no A-Z
    vocab += ascii_chars
    vocab += [f"##{c}" for c in "0123456789abcdefghijklmnopqrstuvwxyz"]
    vocab += list(CJK_PUNCT)
    code = CJK_FIRST
    while len(vocab) < VOCAB_SIZE:
        vocab.append(chr(code))
        code += 1
    return vocab


def write_tokenizer(out: Path, max_length: int) -> None:
    """Save a fast BERT tokenizer (tokenizer.json + vocab.txt) that splits every CJK character into its own token."""
    from transformers import BertTokenizerFast

    vocab_file = out / "vocab.txt"
    vocab_file.write_text("\n".join(build_vocab()) + "\n", encoding="utf-8")
    tok = BertTokenizerFast(vocab_file=str(vocab_file), do_lower_case=True, tokenize_chinese_chars=True,
                            model_max_length=max_length)
    tok.save_pretrained(str(out))


def _expected_marker(kind: str, seed: int) -> dict:
    """What the marker file of a finished synthetic model dir says (a dir whose marker differs is rebuilt)."""
    a = ARCHS[kind]
    return {"synthetic": True, "kind": kind, "seed": seed, "layers": a.layers, "hidden": a.hidden, "heads": a.heads,
            "intermediate": a.intermediate, "vocab": a.vocab, "positions": a.positions, "format": 1,
            "note": "SYNTHETIC: random weights with the architecture of BAAI/" + kind
                    + "-v1.5; vectors are meaningless"}


class Dims(Protocol):
    """The dimensions of an embedder (Arch) or a reranker (rerank_synthetic.RerankArch), read-only."""

    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def positions(self) -> int: ...


def config_sizes(a: Dims) -> dict[str, int]:
    """The dimensions as transformers' BertConfig and XLMRobertaConfig name them."""
    return {"vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads, "intermediate_size": a.intermediate,
            "max_position_embeddings": a.positions}


def is_built(out: Path, marker: dict) -> bool:
    """Whether out is a finished synthetic model dir for marker (same marker, tokenizer written): reuse it."""
    path = out / MARKER_FILE
    return path.is_file() and json.loads(path.read_text()) == marker and (out / "tokenizer.json").is_file()


def finish(out: Path, marker: dict) -> None:
    """Write the marker, last: a half-written dir has none (or an old one) and is rebuilt next time."""
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2))


def synthetic_model_dir(kind: str, cache_dir: Path, seed: int = 0) -> Path:
    """Build (or reuse) a HF model dir for embedder `kind` under cache_dir; same seed, same bytes (the rerankers:
    rerank_synthetic.synthetic_reranker_dir; export.source picks)."""
    if kind not in ARCHS:
        raise ExportError(f"synthetic model {kind!r} is unknown; use synthetic:bge-large-zh or synthetic:bge-small-zh "
                          "(embedders), synthetic:bge-reranker-large or synthetic:bge-reranker-small (rerankers).")
    import torch
    from transformers import BertConfig, BertModel

    out = cache_dir / "synthetic" / f"{kind}-seed{seed}"
    marker = _expected_marker(kind, seed)
    if is_built(out, marker):
        return out
    out.mkdir(parents=True, exist_ok=True)
    a = ARCHS[kind]
    config = BertConfig(**config_sizes(a), type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0,
                        architectures=["BertModel"])
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer(out, a.positions)
    pool = out / "1_Pooling"
    pool.mkdir(exist_ok=True)
    (pool / "config.json").write_text(json.dumps({
        "word_embedding_dimension": a.hidden, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": a.positions, "do_lower_case": True}))
    finish(out, marker)
    return out

"""Synthetic BGE rerankers: XLMRobertaForSequenceClassification (one label) with seeded random weights and a
generated tokenizer with XLM-R's special tokens and pair template (<s> A </s></s> B </s>).

For speed work and tests without the hub: shapes, FLOPs and the pair layout match BAAI/bge-reranker-large, the
scores mean nothing. Every CJK character is one token, as in synthetic:bge-large-zh.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .synthetic import CJK_FIRST, CJK_PUNCT, config_sizes, finish, is_built

XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3, as in xlm-roberta; <mask> is the last entry
TOKENIZER_SIZE = 21128


@dataclass(frozen=True)
class RerankArch:
    """XLM-RoBERTa dimensions of one reranker."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int  # rows of the word-embedding table (>= the generated tokenizer's size)
    positions: int = 514  # XLM-R: 512 usable + padding_idx + 1


# bge-reranker-large: xlm-roberta-large trunk (24 x 1024, 16 heads, 4096 FFN, 250002 rows), one logit.
# bge-reranker-small: the same layout, small enough for tests (not a published model).
RERANK_ARCHS: dict[str, RerankArch] = {
    "bge-reranker-large": RerankArch(layers=24, hidden=1024, heads=16, intermediate=4096, vocab=250002),
    "bge-reranker-small": RerankArch(layers=2, hidden=128, heads=4, intermediate=512, vocab=TOKENIZER_SIZE),
}


def build_vocab(size: int = TOKENIZER_SIZE) -> list[str]:
    """XLM-R specials at their ids, ASCII, ##-pieces, CJK punctuation and ideographs, <mask> last."""
    vocab = list(XLMR_SPECIALS) + [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab += [f"##{c}" for c in "0123456789abcdefghijklmnopqrstuvwxyz"] + list(CJK_PUNCT)
    code = CJK_FIRST
    while len(vocab) < size - 1:
        vocab.append(chr(code))
        code += 1
    return [*vocab, "<mask>"]


def write_tokenizer(out: Path, max_length: int) -> None:
    """A fast XLM-R-style tokenizer (tokenizer.json): BERT's CJK split and word pieces, XLM-R's pair template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import XLMRobertaTokenizerFast

    vocab = build_vocab()
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.RobertaProcessing(sep=("</s>", 2), cls=("<s>", 0))
    tok.decoder = decoders.WordPiece()
    fast = XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                   model_max_length=max_length)
    fast.save_pretrained(str(out))


def _marker(kind: str, seed: int) -> dict:
    a = RERANK_ARCHS[kind]
    return {"synthetic": True, "kind": kind, "task": "rerank", "seed": seed, "layers": a.layers, "hidden": a.hidden,
            "heads": a.heads, "intermediate": a.intermediate, "vocab": a.vocab, "positions": a.positions,
            "format": 1, "note": f"SYNTHETIC: random weights with the architecture of BAAI/{kind}; scores are "
                                 "meaningless"}


def synthetic_reranker_dir(kind: str, cache_dir: Path, seed: int = 0) -> Path:
    """Build (or reuse) a HF model dir of reranker `kind` under cache_dir; same seed, same bytes."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    out = cache_dir / "synthetic" / f"{kind}-seed{seed}"
    marker = _marker(kind, seed)
    if is_built(out, marker):
        return out
    out.mkdir(parents=True, exist_ok=True)
    a = RERANK_ARCHS[kind]
    config = XLMRobertaConfig(
        **config_sizes(a), type_vocab_size=1, hidden_act="gelu", layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, num_labels=1, architectures=["XLMRobertaForSequenceClassification"],
    )
    torch.manual_seed(seed)
    model = XLMRobertaForSequenceClassification(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer(out, a.positions - 2)
    finish(out, marker)
    return out

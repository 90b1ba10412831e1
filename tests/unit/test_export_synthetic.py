"""Synthetic BGE: the generated vocab, the tokenizer and the architecture (the export itself: tests/integration)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bge_triton.export.synthetic import ARCHS, SPECIAL_IDS, VOCAB_SIZE, build_vocab, synthetic_model_dir


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def small_dir(cache) -> Path:
    return synthetic_model_dir("bge-small-zh", cache, seed=0)


@pytest.fixture(scope="module")
def tokenizer(small_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(small_dir))


def test_vocab_size_and_special_ids():
    vocab = build_vocab()
    assert len(vocab) == VOCAB_SIZE == 21128 and len(set(vocab)) == VOCAB_SIZE
    for tok, idx in SPECIAL_IDS.items():
        assert vocab[idx] == tok


def test_every_cjk_char_is_one_token(tokenizer):
    text = "我们今天去北京大学图书馆借书，顺便喝咖啡。"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.convert_tokens_to_ids(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) == [0, 100, 101, 102, 103]
    full = tokenizer(text)["input_ids"]
    assert full[0] == 101 and full[-1] == 102


def test_real_reviews_tokenize_mostly_known(tokenizer):
    from bge_triton.export.corpus import chinese_reviews

    ids = tokenizer(list(chinese_reviews()[:300]), add_special_tokens=False)["input_ids"]
    flat = [i for row in ids for i in row]
    assert sum(i == 100 for i in flat) / len(flat) < 0.02


def test_architecture_matches_bge(small_dir):
    cfg = json.loads((small_dir / "config.json").read_text())
    dims = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"])
    assert dims == (4, 512, 8, 2048)
    assert cfg["vocab_size"] == 21128 and cfg["max_position_embeddings"] == 512
    large = ARCHS["bge-large-zh"]
    assert (large.layers, large.hidden, large.heads, large.intermediate) == (24, 1024, 16, 4096)


def test_seeded_weights_are_reproducible(small_dir, tmp_path):
    from safetensors.numpy import load_file

    again = synthetic_model_dir("bge-small-zh", tmp_path, seed=0)
    a, b = load_file(str(small_dir / "model.safetensors")), load_file(str(again / "model.safetensors"))
    key = "encoder.layer.0.attention.self.query.weight"
    assert np.array_equal(a[key], b[key])

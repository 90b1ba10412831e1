"""The text endpoint's stages (text_stages.py) with a real WordPiece tokenizer and a fake encoder."""
from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from bge_triton.server.repository import DEFAULT_CANONICAL

sys.path.insert(0, str(DEFAULT_CANONICAL / "bge_large_zh" / "1"))  # as the python backend stub does

from text_core import (BadInput, EncoderBackend, EncoderFailed, EncoderOverloaded, TextSettings,  # noqa: E402
                       TooLong, encoder_error)
from text_stages import TextPipeline, Tokenizers, decode, pad  # noqa: E402

WORDS = ["hello", "world", "fast", "embedding", "##s", "rag", "今", "天", "气", "很", "好", "poison"]
VOCAB = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
POISON = VOCAB["poison"]
DIM = 16


def tiny_tokenizer() -> Tokenizer:
    """A BERT-style WordPiece tokenizer ([CLS] text [SEP], CJK characters one token each)."""
    tok = Tokenizer(models.WordPiece(VOCAB, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", VOCAB["[CLS]"]), ("[SEP]", VOCAB["[SEP]"])])
    return tok


class FakeEncoder(EncoderBackend):
    """Mean of a fixed random table over the real tokens, L2-normalised: padding cannot change it."""

    def __init__(self, overlaps: bool = False, fail: str | None = None) -> None:
        self.table = np.random.default_rng(0).standard_normal((len(VOCAB), DIM)).astype(np.float32)
        self.overlaps, self.fail = overlaps, fail
        self.shapes: list[tuple[int, int]] = []
        self.holds = self.in_flight = self.peak = 0

    def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self.shapes.append(ids.shape)
        if self.fail and (ids == POISON).any():
            raise encoder_error("fake_onnx", self.fail)
        vecs = (self.table[ids] * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)

    async def arun(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.001)  # let the other sub-batches start
        self.in_flight -= 1
        return self.run(ids, mask)

    def hold(self):
        self.holds += 1
        return super().hold()


def pipeline(backend: EncoderBackend | None = None, **settings) -> TextPipeline:
    s = TextSettings(**{"max_length": 12, **settings})
    return TextPipeline(s, Tokenizers(tiny_tokenizer(), s.max_length), backend or FakeEncoder(), DIM)


def req(*texts, **params):
    raw = np.array([t if isinstance(t, bytes) else t.encode() for t in texts], dtype=object).reshape(-1, 1)
    return raw, json.dumps(params) if params else None


TEXTS = ["hello", "hello world", "fast embeddings", "今天天气很好", "rag " * 9, "world fast hello rag"]


def test_decode_names_the_bad_text_and_reads_truncate() -> None:
    assert decode(*req("hello", "今天")) == (["hello", "今天"], True)
    assert decode(*req("hello", truncate=False)) == (["hello"], False)
    assert decode(*req("hello", truncate="false")) == (["hello"], False)
    assert decode(np.array(["already str"], dtype=object)) == (["already str"], True)
    for texts, match in (((b"ok", b"\xff\xfe"), "text 1 is not valid UTF-8"), (("a\x00b",), "text 0 contains a NUL"),
                         (("  \n",), "text 0 is empty or whitespace only")):
        with pytest.raises(BadInput, match=match):
            decode(*req(*texts))


def test_tokenizers_truncate_or_count_exactly() -> None:
    tok = Tokenizers(tiny_tokenizer(), 6)
    long = "hello world " * 5
    trunc, full = tok.encode([long], True)[0], tok.encode([long], False)[0]
    assert len(trunc) == 6 and trunc[0] == VOCAB["[CLS]"] and trunc[-1] == VOCAB["[SEP]"]
    assert len(full) == 12 and full[:5] == trunc[:5]
    assert tok.encode(["今天", "hello"], True) == [[2, VOCAB["今"], VOCAB["天"], 3], [2, VOCAB["hello"], 3]]
    assert tok.pad_id == VOCAB["[PAD]"]


def test_pad_builds_ids_and_mask() -> None:
    ids, mask = pad([[2, 4, 3], [2, 3], [2, 5, 6, 3]], [1, 2], 8, 0)
    assert ids.shape == mask.shape == (2, 8) and ids.dtype == np.int64
    assert ids[0].tolist() == [2, 3, 0, 0, 0, 0, 0, 0] and mask[1].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("overlaps, max_in_flight", [(False, 1), (True, 2)])
def test_batch_of_n_equals_n_singles(overlaps: bool, max_in_flight: int) -> None:
    enc = FakeEncoder(overlaps=overlaps)
    p = pipeline(enc, sub_batch_max=2, token_budget=64, max_in_flight=max_in_flight)
    singles = [p([req(t)])[0] for t in TEXTS]
    batch = p([req(t) for t in TEXTS[:4]] + [req(*TEXTS[4:])])  # four requests of one text, one of two
    got = np.concatenate(batch)
    assert got.shape == (len(TEXTS), DIM)
    np.testing.assert_allclose(got, np.concatenate(singles), atol=1e-6)
    assert len(enc.shapes) > len(TEXTS)  # the batch ran as several sub-batches
    if overlaps:
        assert enc.peak == max_in_flight  # sub-batches overlapped, never more than max_in_flight


def test_sub_batches_keep_budget_size_and_padding_multiple() -> None:
    enc = FakeEncoder()
    p = pipeline(enc, sub_batch_max=3, token_budget=24, pad_to_multiple=4, split_overhead_tokens=0)
    batch = p.encode_pre([req(*TEXTS)])
    p.encode_core(batch)
    assert enc.holds == 1  # the backend is held once for the whole Triton batch
    for rows, length in enc.shapes:
        assert length % 4 == 0 and rows <= 3 and (rows == 1 or rows * length <= 24)
    assert sum(rows for rows, _ in enc.shapes) == len(TEXTS)
    assert batch.real_tokens == sum(len(r) for r in batch.ids) < batch.padded_tokens


def test_a_bad_request_fails_alone() -> None:
    p = pipeline(sub_batch_max=8)
    good = [req("hello"), req("今天天气很好"), req("fast", "rag")]
    bad = [req(b"\xff"), req("hello", ""), req("hello " * 20, truncate=False)]
    out = p([good[0], bad[0], good[1], bad[1], bad[2], good[2]])
    assert isinstance(out[1], BadInput) and "not valid UTF-8" in out[1].message
    assert isinstance(out[3], BadInput) and "text 1 is empty" in out[3].message
    assert isinstance(out[4], TooLong) and "text 0 has 22 tokens, over the limit of 12" in out[4].message
    for got, r in zip((out[0], out[2], out[5]), good):
        np.testing.assert_allclose(got, p([r])[0], atol=1e-6)
    assert p.encode_pre([bad[0], good[0], bad[2]]).rejected == 2
    assert isinstance(p([req("hello " * 20)])[0], np.ndarray)  # truncate=true (default) embeds it


@pytest.mark.parametrize("overlaps", [False, True])
@pytest.mark.parametrize("message, kind", [("Exceeds maximum queue size", EncoderOverloaded),
                                           ("onnxruntime error: bad input", EncoderFailed)])
def test_a_failed_sub_batch_fails_only_its_requests(overlaps: bool, message: str, kind: type) -> None:
    p = pipeline(FakeEncoder(overlaps=overlaps, fail=message), sub_batch_max=1, max_in_flight=2)
    out = p([req("hello"), req("poison"), req("world", "fast"), req("rag", "poison")])
    assert isinstance(out[1], kind) and isinstance(out[3], kind) and message in out[1].message
    assert out[0].shape == (1, DIM) and out[2].shape == (2, DIM)


def test_no_encodable_request_runs_nothing() -> None:
    enc = FakeEncoder()
    p = pipeline(enc)
    batch = p.encode_pre([req(" "), req(b"\xff")])
    assert not batch.plans and not p.overlapped(batch)
    assert all(isinstance(r, BadInput) for r in p.encode_post(batch)) and enc.shapes == []

"""The text endpoint's stages and scheduler (text_stages.py, text_scheduler.py): a real WordPiece tokenizer,
a fake encoder, requests answered end to end as model.py answers them."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from bge_triton.repository import endpoint_modules

text_core, text_stages, text_scheduler = endpoint_modules()  # the shipped modules, by the names the stub imports
BadInput, EncoderBackend, EncoderFailed = text_core.BadInput, text_core.EncoderBackend, text_core.EncoderFailed
EncoderOverloaded, TextSettings, TooLong = text_core.EncoderOverloaded, text_core.TextSettings, text_core.TooLong
encoder_error = text_core.encoder_error
Job, QueuePolicy, Scheduler = text_scheduler.Job, text_scheduler.QueuePolicy, text_scheduler.Scheduler
TextPipeline, Tokenizers, decode = text_stages.TextPipeline, text_stages.Tokenizers, text_stages.decode

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

    def __init__(self, fail: str | None = None) -> None:
        self.table = np.random.default_rng(0).standard_normal((len(VOCAB), DIM)).astype(np.float32)
        self.fail = fail
        self.shapes: list[tuple[int, int]] = []
        self.holds = self.in_flight = self.peak = 0
        self.lock = threading.Lock()

    def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with self.lock:
            self.shapes.append(ids.shape)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            threading.Event().wait(0.002)  # let the other dispatchers start
            if self.fail and (ids == POISON).any():
                raise encoder_error("fake_onnx", self.fail)
            vecs = (self.table[ids] * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
            return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
        finally:
            with self.lock:
                self.in_flight -= 1

    def hold(self):
        self.holds += 1
        return super().hold()


class Endpoint:
    """The pipeline and a scheduler wired as model.py wires them; __call__ answers a Triton batch."""

    def __init__(self, backend: EncoderBackend | None = None, policy: QueuePolicy | None = None, **settings) -> None:
        self.s = TextSettings(**{"max_length": 12, **settings})
        self.backend = backend or FakeEncoder()
        self.pipeline = TextPipeline(self.s, Tokenizers(tiny_tokenizer(), self.s.max_length))
        self.scheduler = Scheduler(self.s, self.backend, 0, DIM, self.answer, policy=policy or QueuePolicy())
        self.answered: list[Job] = []
        self.cond = threading.Condition()

    def answer(self, job: Job) -> None:
        with self.cond:
            self.answered.append(job)
            self.cond.notify_all()

    def submit(self, requests, default_priority: int = 2) -> list:
        """Per request: a Job (queued) or the input error that answers it at once."""
        batch = self.pipeline.encode_pre(requests)
        out: list = list(batch.errors)
        jobs = []
        for r, start, n in batch.slots:
            out[r] = self.scheduler.new_job(n, batch.priorities[r] or default_priority)
            jobs.append((out[r], batch.ids[start:start + n]))
        self.scheduler.submit(jobs)
        return out

    def wait(self, jobs, timeout_s: float = 30.0) -> None:
        """Until every job is answered (bounded only against a hang). A job is answered before its dispatcher
        decrements `running`: a test about the scheduler's state after the answer waits with idle()/taken()."""
        with self.cond:
            assert self.cond.wait_for(lambda: all(j in self.answered for j in jobs), timeout_s), "unanswered"

    def idle(self, timeout_s: float = 30.0) -> None:
        """Until no dispatcher runs and nothing waits, by the scheduler's condition (notified as they leave)."""
        s = self.scheduler
        with s.cond:
            assert s.cond.wait_for(lambda: not s.running and not s.pending, timeout_s), "the scheduler never went idle"

    def taken(self, timeout_s: float = 30.0) -> None:
        """Until the dispatchers took every pending text: looked at every 10 ms under the scheduler's lock (a take
        notifies nobody), bounded against a hang only."""
        s, deadline = self.scheduler, time.monotonic() + timeout_s
        with s.cond:
            while s.pending:
                assert time.monotonic() < deadline, "the dispatcher never took the pending texts"
                s.cond.wait(0.01)

    def __call__(self, requests) -> list:
        out = self.submit(requests)
        self.wait([j for j in out if isinstance(j, Job)])
        return [(j.error or j.out) if isinstance(j, Job) else j for j in out]

    def close(self) -> None:
        self.scheduler.close()


def pipeline(backend: EncoderBackend | None = None, **settings) -> Endpoint:
    return Endpoint(backend, **settings)


def req(*texts, **params):
    raw = np.array([t if isinstance(t, bytes) else t.encode() for t in texts], dtype=object).reshape(-1, 1)
    return raw, json.dumps(params) if params else None


TEXTS = ["hello", "hello world", "fast embeddings", "今天天气很好", "rag " * 9, "world fast hello rag"]


def test_decode_names_the_bad_text_and_reads_truncate() -> None:
    assert decode(*req("hello", "今天")) == (["hello", "今天"], True, 0, "right")
    assert decode(*req("hello", truncate=False)) == (["hello"], False, 0, "right")
    assert decode(*req("hello", truncate="false", priority_level=1)) == (["hello"], False, 1, "right")
    assert decode(np.array(["already str"], dtype=object)) == (["already str"], True, 0, "right")
    assert decode(*req("hello", truncation_direction="Left")).direction == "left"  # TEI's spelling too
    for bad in (-1, "1", True, 1.5):
        with pytest.raises(BadInput, match="parameter priority_level="):
            decode(*req("hello", priority_level=bad))
    for bad in ("start", 1, "middle"):
        with pytest.raises(BadInput, match="parameter truncation_direction="):
            decode(*req("hello", truncation_direction=bad))
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
    text = "今天 hello world fast rag 天气"  # 8 tokens, 10 with [CLS] and [SEP]
    right, left = tok.encode([text], True, "right")[0], tok.encode([text], True, "left")[0]
    assert right == [2, VOCAB["今"], VOCAB["天"], VOCAB["hello"], VOCAB["world"], 3]  # the end is cut
    assert left == [2, VOCAB["fast"], VOCAB["rag"], VOCAB["天"], VOCAB["气"], 3]  # the start; [CLS], [SEP] stay


def test_truncation_direction_is_per_request_and_counts_are_after_truncation() -> None:
    p = pipeline(max_length=6)
    text = "今天 hello world fast rag 天气"
    batch = p.pipeline.encode_pre([req(text), req(text, truncation_direction="left"),
                                   req(text, truncation_direction="right"), req("hello")])
    assert batch.errors == [None] * 4 and [n for _, _, n in batch.slots] == [1, 1, 1, 1]
    by_request = {r: batch.ids[start] for r, start, _ in batch.slots}
    assert by_request[0] == by_request[2] != by_request[1]
    assert by_request[1][1:3] == [VOCAB["fast"], VOCAB["rag"]] and len(by_request[1]) == 6
    assert batch.tokenize_us >= 0
    p.close()


def test_a_tokenizer_that_raises_fails_only_its_request() -> None:
    p = pipeline()

    class Picky:
        """The real tokenizers, except that any call holding 'rag' raises (as a broken tokenizer might)."""

        def __init__(self, tok) -> None:
            self.tok, self.calls = tok, 0

        def encode(self, texts, truncate, direction="right"):
            self.calls += 1
            if any("rag" in t for t in texts):
                raise RuntimeError("tokenizer exploded")
            return self.tok.encode(texts, truncate, direction)

    p.pipeline.tok = Picky(p.pipeline.tok)
    batch = p.pipeline.encode_pre([req("hello"), req("fast rag"), req("world", "fast")])
    assert batch.errors[0] is None and batch.errors[2] is None
    assert batch.errors[1].kind == "internal" and "tokenizer exploded" in batch.errors[1].message
    assert batch.rejected == 0  # not an input error: kit_rejected_requests_total counts those only
    assert [r for r, _, _ in batch.slots] == [0, 2]
    p.close()


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_batch_of_n_equals_n_singles(max_in_flight: int) -> None:
    enc = FakeEncoder()
    p = pipeline(enc, sub_batch_max=2, token_budget=64, max_in_flight=max_in_flight)
    singles = [p([req(t)])[0] for t in TEXTS]
    batch = p([req(t) for t in TEXTS[:4]] + [req(*TEXTS[4:])])  # four requests of one text, one of two
    got = np.concatenate(batch)
    assert got.shape == (len(TEXTS), DIM)
    np.testing.assert_allclose(got, np.concatenate(singles), atol=1e-6)
    assert len(enc.shapes) > len(TEXTS)  # the batch ran as several sub-batches
    p.close()


class Meeting(FakeEncoder):
    """Holds each call until `n` calls were at the encoder at once (bounded): the overlap is made by progress,
    not hoped for from a 2 ms pause that a busy machine can outlast."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.met = n, threading.Condition()

    def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with self.lock:
            self.shapes.append(ids.shape)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        with self.met:
            self.met.notify_all()
            self.met.wait_for(lambda: self.peak >= self.n, 30)  # fewer allowed at once: the peak assert says so
        try:
            vecs = (self.table[ids] * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
            return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_dispatchers_overlap_up_to_max_in_flight() -> None:
    enc = Meeting(3)
    p = pipeline(enc, sub_batch_max=1, max_in_flight=3)
    p([req(*TEXTS)])
    assert enc.peak == 3 and len(enc.shapes) == len(TEXTS)  # three sub-batches at the encoder at once, never more
    p.close()


def test_sub_batches_keep_budget_size_and_padding_multiple() -> None:
    enc = FakeEncoder()
    p = pipeline(enc, sub_batch_max=3, token_budget=24, pad_to_multiple=4, split_overhead_tokens=0, max_in_flight=1)
    out = p([req(*TEXTS)])
    assert out[0].shape == (len(TEXTS), DIM)
    assert enc.holds == len(enc.shapes)  # the backend is held around each sub-batch
    for rows, length in enc.shapes:
        assert length % 4 == 0 and rows <= 3 and (rows == 1 or rows * length <= 24)
    assert sum(rows for rows, _ in enc.shapes) == len(TEXTS)
    counts = p.scheduler.counters.take()
    assert counts["texts"] == len(TEXTS) and counts["subs"] == len(enc.shapes)
    assert counts["real"] < counts["padded"] == sum(r * n for r, n in enc.shapes)
    p.close()


def test_a_bad_request_fails_alone() -> None:
    p = pipeline(sub_batch_max=8)
    good = [req("hello"), req("今天天气很好"), req("fast", "rag")]
    bad = [req(b"\xff"), req("hello", ""), req("hello " * 20, truncate=False)]
    out = p([good[0], bad[0], good[1], bad[1], bad[2], good[2]])
    assert isinstance(out[1], BadInput) and "not valid UTF-8" in out[1].message
    assert isinstance(out[3], BadInput) and "text 1 is empty" in out[3].message
    assert isinstance(out[4], TooLong) and "text 0 has 22 tokens, over the limit of 12" in out[4].message
    for got, r in zip((out[0], out[2], out[5]), good, strict=True):
        np.testing.assert_allclose(got, p([r])[0], atol=1e-6)
    assert p.pipeline.encode_pre([bad[0], good[0], bad[2]]).rejected == 2
    assert isinstance(p([req("hello " * 20)])[0], np.ndarray)  # truncate=true (default) embeds it
    p.close()


@pytest.mark.parametrize("message, kind", [("Exceeds maximum queue size", EncoderOverloaded),
                                           ("onnxruntime error: bad input", EncoderFailed)])
def test_a_failed_sub_batch_fails_only_its_requests(message: str, kind: type) -> None:
    p = pipeline(FakeEncoder(fail=message), sub_batch_max=1, max_in_flight=2)
    out = p([req("hello"), req("poison"), req("world", "fast"), req("rag", "poison")])
    assert isinstance(out[1], kind) and isinstance(out[3], kind) and message in out[1].message
    assert out[0].shape == (1, DIM) and out[2].shape == (2, DIM)
    p.close()


def test_no_encodable_request_runs_nothing() -> None:
    enc = FakeEncoder()
    p = pipeline(enc)
    out = p([req(" "), req(b"\xff")])
    assert all(isinstance(r, BadInput) for r in out) and enc.shapes == []
    p.close()

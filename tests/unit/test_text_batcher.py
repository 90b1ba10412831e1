"""The text endpoint's scheduler "triton" (model.py + text_batcher.py) under test_text_core_adapter's fake pb_utils.

Triton's dynamic batcher holds the waiting requests; execute() returns a coroutine that the stub runs to completion
(python_backend r24.10, src/pb_stub.cc: Stub::ProcessRequests -> RunCoroutine on the stub's event loop thread, then
ProcessReturnedResponses). The `Stub` below does the same, and the fake BLS request gets r24.10's async_exec (exec in
the running loop's default thread pool). Every batch must come back as exactly one response per request, in order;
each fault is that request's own error; the endpoint serves on. Waits are bounded and driven by events, not timing.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import numpy as np
import pytest
import test_text_core_adapter as adapter
from test_text_core_adapter import InferenceResponse, Request, Tensor, TritonError, load_model
from test_text_core_stages import DIM, VOCAB

from bge_triton.server.repository import TEXT_MODEL_DIR

PAD = VOCAB["[PAD]"]


class Stub:
    """The python backend stub's way with execute's return (default mode): a coroutine runs on the stub's event loop
    (a thread of its own) to completion, then its list is taken; a list is taken as it is."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def execute(self, model, requests) -> list[InferenceResponse]:
        returned = model.execute(requests)
        self.ran_async = asyncio.iscoroutine(returned)  # else the responses themselves (one sub-batch: inline)
        responses = asyncio.run_coroutine_threadsafe(returned, self.loop).result(timeout=30) if self.ran_async \
            else returned
        assert isinstance(responses, list) and len(responses) == len(requests)  # ProcessReturnedResponses' checks
        assert all(isinstance(r, InferenceResponse) for r in responses)
        assert not any(r.sender.done.is_set() for r in requests), "no response through a sender in this mode"
        return responses

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Req(Request):
    """A request as r24.10 hands it to execute: is_cancelled() asks the server (here: an event, counted)."""

    def __init__(self, texts, parameters=None, outputs=("embedding", "token_count")) -> None:
        super().__init__(texts, parameters, outputs)
        self.cancel = threading.Event()
        self.checks = 0

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.cancel.is_set()


def by_tokens(ids: np.ndarray) -> InferenceResponse:
    """An encoder whose embedding of a row depends on its real tokens only (not on padding or its sub-batch)."""
    vecs = np.zeros((ids.shape[0], DIM), np.float32)
    for i, row in enumerate(ids):
        for t in row[row != PAD]:
            vecs[i, int(t) % DIM] += 1.0 + int(t) / 100
    return InferenceResponse([Tensor("embedding", vecs / np.linalg.norm(vecs, axis=1, keepdims=True))])


class Recorder:
    """Records each encoder call's input ids (thread-safe: async_exec runs exec in a thread pool) and the most
    calls that were at the encoder at once; `hold` lets calls wait until that many are at the encoder, or the
    `total` expected calls have come (bounded)."""

    def __init__(self, answer=by_tokens, hold: int = 0, total: int = 0) -> None:
        self.answer, self.hold, self.total = answer, hold, total
        self.calls: list[np.ndarray] = []
        self.now = self.peak = 0
        self.cond = threading.Condition()

    def __call__(self, ids):
        with self.cond:
            self.calls.append(ids)
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.cond.notify_all()
            if self.hold:
                self.cond.wait_for(lambda: self.now >= self.hold or len(self.calls) >= self.total, 10)
        try:
            return self.answer(ids)
        finally:
            with self.cond:
                self.now -= 1

    def sent(self) -> list[int]:
        """The first real token of every row sent (one word per text in these tests)."""
        return [int(i) for ids in self.calls for i in ids[:, 1]]


def _async_exec(self):
    return asyncio.get_running_loop().run_in_executor(None, self.exec)  # as r24.10's pb_stub.cc binds it


def _install(version) -> None:
    adapter_install(version)
    shutil.copyfile(TEXT_MODEL_DIR / "text_batcher.py", version / "text_batcher.py")


adapter_install = adapter.install_text_endpoint


def triton_model(tmp_path, monkeypatch, answer, **params):
    """The model in scheduler 'triton' (text_batcher.py installed beside model.py), its BLS with async_exec."""
    monkeypatch.setattr(adapter, "install_text_endpoint", _install)
    model, pb = load_model(tmp_path, monkeypatch, answer, scheduler="triton", **params)
    pb.InferenceRequest.async_exec = _async_exec
    assert model.batcher is not None and model.scheduler is None
    MARKERS.append(model.batcher.marker.path)
    return model, pb


MARKERS: list[str] = []  # the query markers' files: removed by finalize, and here after a test that failed first


@pytest.fixture(autouse=True)
def _remove_markers():
    yield
    while MARKERS:
        path = MARKERS.pop()
        for leftover in (path, path + ".users"):
            if os.path.exists(leftover):
                os.unlink(leftover)


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.close()


def code(response) -> int | None:
    return response.error().code() if response.has_error() else None


def serves(stub, model) -> None:
    """The endpoint still answers: a batch of two requests (three texts) embeds."""
    responses = stub.execute(model, [Req(["hello", "world"]), Req(["rag"])])
    assert [code(r) for r in responses] == [None, None]
    assert responses[0].output_tensors[0].as_numpy().shape == (2, DIM)


def test_one_response_per_request_in_order_and_equal_to_the_pool_mode(tmp_path, monkeypatch, stub) -> None:
    texts = [["hello", "world"], [" "], ["今天", "rag", "fast rag"], ["hello " * 20], ["rag"], ["world hello fast"]]
    params = [{}, {}, {}, {"truncate": False}, {"priority_level": 1}, {}]
    recorder = Recorder()
    model, _ = triton_model(tmp_path / "t", monkeypatch, recorder, sub_batch_max=2, token_budget=64)
    responses = stub.execute(model, [Req(t, p) for t, p in zip(texts, params, strict=True)])
    assert [code(r) for r in responses] == [None, TritonError.INVALID_ARG, None, TritonError.INVALID_ARG, None, None]
    assert len(recorder.calls) >= 3  # several sub-batches (sub_batch_max 2), planned once for the whole batch
    assert recorder.calls[0][0, 1] == VOCAB["rag"]  # the query's sub-batch went first
    model.finalize()
    pool, _ = load_model(tmp_path / "p", monkeypatch, by_tokens, sub_batch_max=2, token_budget=64)
    expected = adapter.execute(pool, [Request(t, p) for t, p in zip(texts, params, strict=True)])
    pool.finalize()
    for got, want in zip(responses, expected, strict=True):
        assert code(got) == code(want)
        if not got.has_error():
            assert [t.name for t in got.output_tensors] == ["embedding", "token_count"]
            for a, b in zip(got.output_tensors, want.output_tensors, strict=True):
                np.testing.assert_allclose(a.as_numpy(), b.as_numpy(), rtol=0, atol=1e-6)
    assert responses[2].output_tensors[1].as_numpy().tolist() == [[4], [3], [4]]


@pytest.mark.parametrize("fault, words", [
    (lambda ids: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access")), "RuntimeError"),
    (lambda ids: InferenceResponse([Tensor("embedding", np.ones((ids.shape[0], DIM + 1), np.float32))]),
     "answered shape"),
    (lambda ids: InferenceResponse([Tensor("embedding", np.ones((ids.shape[0] + 1, DIM), np.float32))]),
     "answered shape"),
    (lambda ids: InferenceResponse(error=TritonError("onnxruntime: bad things")), "bad things"),
])
def test_an_encoder_fault_fails_its_requests_only_and_their_other_texts_are_not_sent(tmp_path, monkeypatch, stub,
                                                                                     fault, words) -> None:
    def encoder(ids):
        return fault(ids) if (ids == VOCAB["poison"]).any() else by_tokens(ids)

    recorder = Recorder(encoder)
    model, _ = triton_model(tmp_path, monkeypatch, recorder, sub_batch_max=1, max_in_flight=1, query_levels=0)
    # one text per sub-batch, one at a time, shortest first: "poison" (1 token) goes before "world hello" (2)
    requests = [Req(["hello"]), Req(["poison", "world hello", "fast rag hello"]), Req(["rag", "fast"])]
    responses = stub.execute(model, requests)
    assert [code(r) for r in responses] == [None, TritonError.INTERNAL, None]
    assert words in responses[1].error().message()
    assert VOCAB["world"] not in recorder.sent() and VOCAB["fast"] in recorder.sent()  # its texts still to go: not
    assert responses[2].output_tensors[0].as_numpy().shape == (2, DIM)
    serves(stub, model)
    model.finalize()


def test_a_tokenizer_that_raises_answers_its_request_and_the_batch_goes_on(tmp_path, monkeypatch, stub) -> None:
    model, _ = triton_model(tmp_path, monkeypatch, by_tokens)
    real = model.pipeline.tok.encode

    def encode(texts, truncate, direction="right"):
        if any("rag" in t for t in texts):
            raise RuntimeError("tokenizer exploded")
        return real(texts, truncate, direction)

    model.pipeline.tok.encode = encode
    responses = stub.execute(model, [Req(["hello"]), Req(["fast rag"]), Req(["world"])])
    assert [code(r) for r in responses] == [None, TritonError.INTERNAL, None]
    assert "tokenizer exploded" in responses[1].error().message()
    model.pipeline.tok.encode = real
    serves(stub, model)
    model.finalize()


def test_a_cancelled_request_sends_none_of_its_texts_still_to_go(tmp_path, monkeypatch, stub) -> None:
    cancelled = Req(["hello", "world hello", "fast rag hello"])  # three sub-batches, shortest first

    def encoder(ids):
        if ids[0, 1] == VOCAB["hello"] and ids.shape[1] == 3:  # its first text is at the encoder: the client cancels
            cancelled.cancel.set()
        return by_tokens(ids)

    recorder = Recorder(encoder)
    model, _ = triton_model(tmp_path, monkeypatch, recorder, sub_batch_max=1, max_in_flight=1, query_levels=0,
                            pad_to_multiple=1)
    other = Req(["rag", "fast"])
    responses = stub.execute(model, [cancelled, other])
    assert code(responses[0]) == TritonError.CANCELLED and code(responses[1]) is None
    assert "cancelled by its client" in responses[0].error().message()
    assert VOCAB["world"] not in recorder.sent() and VOCAB["fast"] in recorder.sent()
    assert recorder.sent().count(VOCAB["hello"]) == 1  # only the text that was already at the encoder
    assert cancelled.checks == 1  # asked before its second sub-batch (a first sub-batch goes without asking)
    serves(stub, model)
    model.finalize()


def test_a_request_cancelled_before_its_first_sub_batch_sends_nothing_once_it_waited(tmp_path, monkeypatch,
                                                                                      stub) -> None:
    """A request whose first sub-batch comes late in the batch is asked once it waited cancel_check_s (a fake clock
    that each encoder call moves on by 1 s); one whose sub-batch starts at once is not asked."""
    now = [0.0]

    def encoder(ids):
        now[0] += 1.0
        return by_tokens(ids)

    model, _ = triton_model(tmp_path, monkeypatch, encoder, sub_batch_max=1, max_in_flight=1, query_levels=0,
                            cancel_check_s=0.5, pad_to_multiple=1)
    model.batcher.clock = lambda: now[0]
    first, late = Req(["rag", "fast"]), Req(["world hello fast"])  # sub-batches: rag, fast, then the longer text
    late.cancel.set()  # cancelled by its client while it waited
    responses = stub.execute(model, [first, late])
    assert code(responses[0]) is None and code(responses[1]) == TritonError.CANCELLED
    assert late.checks == 1 and first.checks == 1  # "rag" went unasked; "fast" after "rag" had been sent
    model.finalize()


def test_no_cancellation_check_when_cancel_check_s_is_0(tmp_path, monkeypatch, stub) -> None:
    model, _ = triton_model(tmp_path, monkeypatch, by_tokens, sub_batch_max=1, max_in_flight=1, cancel_check_s=0)
    request = Req(["hello", "world", "rag"])
    request.cancel.set()
    (response,) = stub.execute(model, [request])
    assert code(response) is None and request.checks == 0
    model.finalize()


@pytest.mark.parametrize("message", ["Server is stopping", "Server not ready", "Exceeds maximum queue size"])
def test_a_stopping_server_is_unavailable(tmp_path, monkeypatch, stub, message) -> None:
    answer = lambda ids: InferenceResponse(error=TritonError(message))  # noqa: E731 - code INTERNAL, as r24.10 hands it
    model, _ = triton_model(tmp_path, monkeypatch, answer)
    responses = stub.execute(model, [Req(["hello"]), Req(["rag", "world"])])
    assert [code(r) for r in responses] == [TritonError.UNAVAILABLE] * 2
    assert message in responses[0].error().message()
    model.finalize()


def test_a_fault_inside_execute_answers_every_request(tmp_path, monkeypatch, stub) -> None:
    model, _ = triton_model(tmp_path, monkeypatch, by_tokens, sub_batch_max=1)

    def broken(*args):
        raise RuntimeError("a bug in the batcher")

    async def broken_async(*args):
        broken()

    model.batcher.prepare = broken  # in execute itself
    responses = stub.execute(model, [Req(["hello"]), Req([" "])])
    assert not stub.ran_async and [code(r) for r in responses] == [TritonError.INTERNAL] * 2
    assert "a bug in the batcher" in responses[0].error().message()
    del model.batcher.prepare
    model.batcher.run_planned = broken_async  # in the coroutine
    responses = stub.execute(model, [Req(["hello", "world"]), Req(["rag"])])
    assert stub.ran_async and [code(r) for r in responses] == [TritonError.INTERNAL] * 2
    del model.batcher.run_planned
    serves(stub, model)
    model.finalize()


def test_at_most_max_in_flight_sub_batches_at_the_encoder(tmp_path, monkeypatch, stub) -> None:
    recorder = Recorder(hold=2, total=5)  # each call waits until two are at the encoder (or the last came)
    model, _ = triton_model(tmp_path, monkeypatch, recorder, sub_batch_max=1, max_in_flight=2, query_levels=0)
    responses = stub.execute(model, [Req(["hello", "world", "rag", "fast", "hello world"])])
    assert code(responses[0]) is None and len(recorder.calls) == 5
    assert recorder.peak == 2  # concurrent (async_exec), and bounded by max_in_flight
    model.finalize()


def test_query_mode_cuts_bulk_to_short_sub_batches_run_one_at_a_time(tmp_path, monkeypatch, stub) -> None:
    recorder = Recorder()
    model, _ = triton_model(tmp_path, monkeypatch, recorder, sub_batch_max=64, max_in_flight=2, token_budget=4096,
                            query_token_budget=16, pad_to_multiple=4)
    bulk = Req(["hello world"] * 12)  # 4 tokens each: one sub-batch of 12 outside query mode
    (alone,) = stub.execute(model, [bulk])
    assert code(alone) is None and [c.shape for c in recorder.calls] == [(12, 4)]
    recorder.calls.clear()
    responses = stub.execute(model, [Req(["hello world"] * 12), Req(["rag"], {"priority_level": 1})])
    assert [code(r) for r in responses] == [None, None]
    assert recorder.calls[0].shape == (1, 4) and recorder.calls[0][0, 1] == VOCAB["rag"]  # the query first
    assert [c.shape for c in recorder.calls[1:]] == [(4, 4)] * 3  # bulk at most 16 tokens a call
    np.testing.assert_array_equal(responses[0].output_tensors[0].as_numpy(), alone.output_tensors[0].as_numpy())
    recorder.calls.clear()
    (after,) = stub.execute(model, [Req(["hello world"] * 12)])  # within query_window_s of the query: still short
    assert code(after) is None and [c.shape for c in recorder.calls] == [(4, 4)] * 3
    model.finalize()


def test_query_mode_bulk_runs_one_at_a_time(tmp_path, monkeypatch, stub) -> None:
    """While the first short bulk sub-batch is at the encoder, the event loop is run several rounds: no second call
    is submitted (async_exec counts submissions on the loop itself, so this does not depend on thread timing)."""
    submitted: list[int] = []
    seen: list[int] = []

    def encoder(ids):
        for _ in range(5):  # let the loop run everything that is ready
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), stub.loop).result(10)
        seen.append(len(submitted))
        return by_tokens(ids)

    model, pb = triton_model(tmp_path, monkeypatch, encoder, sub_batch_max=64, max_in_flight=2,
                             query_token_budget=8, pad_to_multiple=4)

    def counting(self):
        submitted.append(1)
        return _async_exec(self)

    pb.InferenceRequest.async_exec = counting
    model.batcher.last_query = model.batcher.clock()  # a query was just seen
    model.batcher.clock = lambda: model.batcher.last_query  # and the window never ends in this test
    (response,) = stub.execute(model, [Req(["hello world"] * 4)])
    assert code(response) is None and seen == [1, 2]  # two calls of 2 texts, the second only after the first
    model.batcher.last_query, model.batcher.clock = float("-inf"), time.monotonic  # outside query mode: they overlap
    model.batcher.s = type(model.batcher.s)(**{**vars(model.batcher.s), "token_budget": 8})
    seen.clear()
    submitted.clear()
    (response,) = stub.execute(model, [Req(["hello world"] * 4)])
    assert code(response) is None and seen == [2, 2]
    model.finalize()


def test_a_batch_of_one_sub_batch_runs_inline_and_more_go_through_the_event_loop(tmp_path, monkeypatch, stub) -> None:
    submitted: list[int] = []
    model, pb = triton_model(tmp_path, monkeypatch, by_tokens, sub_batch_max=4)

    def counting(self):
        submitted.append(1)
        return _async_exec(self)

    pb.InferenceRequest.async_exec = counting
    responses = stub.execute(model, [Req(["hello"]), Req(["rag", "world"])])
    assert not stub.ran_async and not submitted  # one sub-batch: the blocking BLS exec in execute, no loop hop
    assert [code(r) for r in responses] == [None, None]
    responses = stub.execute(model, [Req(["hello", "world", "rag", "fast", "hello world"])])
    assert stub.ran_async and len(submitted) == 2 and code(responses[0]) is None  # two sub-batches: async_exec
    model.batcher.last_query = model.batcher.clock() + 3600  # query mode: even one bulk sub-batch goes the slow way
    (response,) = stub.execute(model, [Req(["hello"])])
    assert stub.ran_async and len(submitted) == 3 and code(response) is None
    (response,) = stub.execute(model, [Req(["rag"], {"priority_level": 1})])  # but a query alone runs inline
    assert not stub.ran_async and len(submitted) == 3 and code(response) is None
    model.finalize()


def test_the_triton_mode_and_its_query_model_are_rendered_from_the_committed_config() -> None:
    from bge_triton.server.repository import (
        DEFAULT_CANONICAL,
        TritonMode,
        load_config,
        parse_config,
        query_model_config,
        text_settings,
        triton_mode_config,
    )
    from bge_triton.server.repository import dump_config as dump

    committed = load_config(DEFAULT_CANONICAL / "bge_large_zh")
    assert text_settings(committed).scheduler == "pool"  # the committed mode stays the pool
    cfg = triton_mode_config(committed, TritonMode(max_batch_size=512, instances=3, max_in_flight=2,
                                                   bulk_max_queue_size=100, query_max_queue_size=50))
    assert parse_config(dump(cfg)) == cfg  # Triton's schema reads it back
    assert text_settings(cfg).scheduler == "triton" and text_settings(cfg).max_in_flight == 2
    assert cfg.max_batch_size == 512 and cfg.instance_group[0].count == 3
    db = cfg.dynamic_batching
    assert db.max_queue_delay_microseconds == 0 and not db.preferred_batch_size
    assert (db.priority_levels, db.default_priority_level) == (2, 2)
    assert db.default_queue_policy.max_queue_size == 100 and db.priority_queue_policy[1].max_queue_size == 50
    assert db.priority_queue_policy[1].allow_timeout_override and db.default_queue_policy.allow_timeout_override
    query = query_model_config(committed)
    assert query.name == "bge_large_zh_query" and query.dynamic_batching.default_priority_level == 1
    assert text_settings(query).onnx_model == "bge_large_zh_onnx"  # the same encoder (and so the same QueryMarker)
    assert committed.max_batch_size == 128 and text_settings(committed).scheduler == "pool"  # copies, not edits


def test_the_encoders_marker_is_shared_and_removed_by_the_last_model_to_close(tmp_path) -> None:
    """A bulk model and its query model share the encoder's marker: one unloading leaves the file (the other still
    marks and reads it, and a model loaded later opens the same one); the last removes it."""
    import text_batcher

    name = f"enc_{tmp_path.name}"
    bulk, query = text_batcher.SharedMarker(name), text_batcher.SharedMarker(name)
    query.mark(123.0)
    assert bulk.path == query.path and bulk.last() == 123.0
    query.close()
    assert os.path.exists(bulk.path)
    later = text_batcher.SharedMarker(name)
    later.mark(456.0)
    assert bulk.last() == 456.0
    assert bulk.try_bulk() and not later.try_bulk()  # the bulk slot: one holder at a time, models apart
    bulk.release_bulk()
    later.close()
    assert os.path.exists(bulk.path)
    bulk.close()
    assert not os.path.exists(bulk.path) and not os.path.exists(bulk.users_path)

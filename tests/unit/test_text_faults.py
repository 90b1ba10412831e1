"""Fault injection into the shipped text endpoint (model.py + scheduler under the fake pb_utils of
test_text_core_adapter): every request gets exactly one final response, and the endpoint keeps serving.

Each sender counts every send() call; the checks run after finalize() joined the scheduler's threads, so
a late second answer would be counted. Waits are bounded and driven by events, never by sleeps.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from test_text_core_adapter import FINAL, InferenceResponse, Request, Sender, TritonError, execute, load_model, ok
from test_text_core_stages import DIM, VOCAB


class Counting(Sender):
    """Records every send (a second one is a defect the test reports, not an exception in the endpoint)."""

    def __init__(self, fail_times: int = 0, cancelled: threading.Event | None = None) -> None:
        super().__init__()
        self.calls: list[InferenceResponse] = []
        self.fail_times = fail_times
        self.cancel = cancelled or threading.Event()
        self.checks = self.late_checks = 0

    def send(self, response=None, flags=0) -> None:
        assert flags == FINAL
        if self.fail_times:
            self.fail_times -= 1
            raise RuntimeError("Unable to send response: the response sender is closed")  # as r24.10 can
        self.calls.append(response)
        self.responses.append(response)
        self.done.set()

    def is_cancelled(self) -> bool:
        self.checks += 1
        if self.done.is_set():  # r24.10: the server deleted the response factory: a read of freed memory there
            self.late_checks += 1
        return self.cancel.is_set()


def request(texts, parameters=None, timeout_us: int = 0, **kw) -> Request:
    r = Request(texts, parameters)
    r.sender = Counting(**kw)
    r.timeout = lambda: timeout_us
    return r


def answered(requests, timeout_s: float = 30.0) -> None:
    for r in requests:
        assert r.sender.done.wait(timeout_s), "a request was never answered"


def once(requests) -> None:
    """Exactly one final response each (checked after finalize joined the threads), and no is_cancelled() after it."""
    assert [len(r.sender.calls) for r in requests] == [1] * len(requests)
    assert sum(r.sender.late_checks for r in requests) == 0


def code(r: Request) -> int | None:
    response = r.sender.calls[0]
    return response.error().code() if response.has_error() else None


class Gate:
    """An encoder answer that records each call and blocks until opened (bounded)."""

    def __init__(self, answer=ok) -> None:
        self.calls: list[np.ndarray] = []
        self.cond = threading.Condition()
        self.open = threading.Event()
        self.answer = answer

    def __call__(self, ids):
        with self.cond:
            self.calls.append(ids)
            self.cond.notify_all()
        assert self.open.wait(60), "the test never opened the gate"  # bounds a hang only
        return self.answer(ids)

    def arrived(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.calls) >= n, 30), f"{len(self.calls)} calls, expected {n}"


def serves(model) -> None:
    """The endpoint still answers: a two-text request (through the dispatchers) embeds."""
    (response,) = execute(model, [request(["hello", "world"])])  # returned inline, or sent by a dispatcher
    assert not response.has_error() and response.output_tensors[0].as_numpy().shape == (2, DIM)
    assert all(t.is_alive() for t in model.scheduler.threads), "a scheduler thread died"


def test_a_sender_that_raises_strands_nobody(tmp_path, monkeypatch) -> None:
    model, _ = load_model(tmp_path, monkeypatch, ok, sub_batch_max=1, max_in_flight=1)
    broken = request(["hello", "rag"], fail_times=1)  # its embeddings cannot be sent: an error response goes
    dead = request(["fast", "world"], fail_times=5)  # nothing can be sent at all: logged, the thread goes on
    fine = request(["world", "rag"])
    for r in (broken, dead, fine):
        assert model.execute([r]) is None
    answered([broken, fine])
    assert code(broken) == TritonError.INTERNAL and "could not send" in broken.sender.calls[0].error().message()
    assert code(fine) is None
    serves(model)
    model.finalize()
    once([broken, fine])
    assert dead.sender.calls == [] and dead.sender.fail_times == 3  # tried twice (response, then error), no more


@pytest.mark.parametrize("fault, words", [
    (lambda ids: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access")), "RuntimeError"),
    (lambda ids: InferenceResponse([type(ok(ids).output_tensors[0])("embedding", np.ones((ids.shape[0], DIM + 1),
                                                                                        np.float32))]),
     "answered shape"),
    (lambda ids: InferenceResponse([type(ok(ids).output_tensors[0])("embedding", np.ones((1, DIM), np.float32))]),
     "answered shape"),
])
def test_an_encoder_that_raises_or_answers_the_wrong_shape_fails_its_requests_only(tmp_path, monkeypatch, fault,
                                                                                     words) -> None:
    def encoder(ids):
        return fault(ids) if (ids == VOCAB["poison"]).any() else ok(ids)

    model, _ = load_model(tmp_path, monkeypatch, encoder, sub_batch_max=2, max_in_flight=2)
    requests = [request(["hello", "world", "fast"]), request(["poison", "rag", "hello"]), request(["rag"])]
    assert model.execute(requests) is None
    answered(requests)
    assert code(requests[1]) == TritonError.INTERNAL and words in requests[1].sender.calls[0].error().message()
    serves(model)
    model.finalize()
    once(requests)


def test_a_failed_requests_waiting_texts_never_reach_the_encoder(tmp_path, monkeypatch) -> None:
    sent: list[int] = []

    def encoder(ids):
        sent.extend(int(i) for i in ids[:, 1])
        if (ids == VOCAB["poison"]).any():
            return InferenceResponse(error=TritonError("onnxruntime: bad things"))
        return ok(ids)

    model, _ = load_model(tmp_path, monkeypatch, encoder, sub_batch_max=1, max_in_flight=1, query_levels=0)
    failing = request(["poison", "rag", "world"])
    assert model.execute([failing]) is None
    answered([failing])
    serves(model)
    model.finalize()
    once([failing])
    assert code(failing) == TritonError.INTERNAL
    assert VOCAB["rag"] not in sent and sent.count(VOCAB["world"]) == 1  # "world" only from serves()


def test_a_tokenizer_that_raises_answers_its_request_and_the_batch_goes_on(tmp_path, monkeypatch) -> None:
    model, _ = load_model(tmp_path, monkeypatch, ok)
    real = model.pipeline.tok.encode

    def encode(texts, truncate, direction="right"):
        if any("rag" in t for t in texts):
            raise RuntimeError("tokenizer exploded")
        return real(texts, truncate, direction)

    model.pipeline.tok.encode = encode
    responses = model.execute([request(["hello"]), request(["fast rag"]), request(["world"])])
    assert [r.has_error() for r in responses] == [False, True, False]  # one sub-batch: answered inline
    assert responses[1].error().code() == TritonError.INTERNAL
    assert "tokenizer exploded" in responses[1].error().message()
    serves(model)
    model.finalize()


def test_a_fault_inside_execute_answers_every_request_once(tmp_path, monkeypatch) -> None:
    model, _ = load_model(tmp_path, monkeypatch, ok, sub_batch_max=1)
    model.scheduler.submit = lambda jobs: (_ for _ in ()).throw(RuntimeError("a bug in submit"))
    requests = [request(["hello", "world"]), request([" "]), request(["rag", "fast"])]
    assert model.execute(requests) is None  # senders were taken: every answer goes through them
    assert code(requests[1]) == TritonError.INVALID_ARG  # answered before the fault, not again
    assert code(requests[0]) == code(requests[2]) == TritonError.INTERNAL
    assert "a bug in submit" in requests[0].sender.calls[0].error().message()
    del model.scheduler.submit
    serves(model)
    model.finalize()
    once(requests)


def test_a_cancelled_request_sends_none_of_its_waiting_texts(tmp_path, monkeypatch) -> None:
    gate = Gate()
    model, _ = load_model(tmp_path, monkeypatch, gate, sub_batch_max=1, max_in_flight=1, query_levels=0,
                          cancel_check_s=0.01)
    first = request(["hello"] * 2)
    assert model.execute([first]) is None
    gate.arrived(1)  # the dispatcher is at the encoder with the first text
    cancelled = request(["rag", "fast", "world"])
    assert model.execute([cancelled]) is None
    cancelled.sender.cancel.set()  # the client cancels while all three texts wait
    answered([cancelled])  # the reaper found it (bounded wait, no sleep)
    gate.open.set()
    answered([first])
    serves(model)
    model.finalize()
    once([first, cancelled])
    assert code(cancelled) == TritonError.CANCELLED and code(first) is None
    sent = {int(i) for ids in gate.calls for i in ids[:, 1]}
    assert not sent & {VOCAB["rag"], VOCAB["fast"]}  # none of its texts reached the encoder


def test_a_request_timeout_shorter_than_the_default_is_honoured(tmp_path, monkeypatch) -> None:
    gate = Gate()
    model, _ = load_model(tmp_path, monkeypatch, gate, sub_batch_max=1, max_in_flight=1, query_levels=0)
    now = [100.0]
    model.scheduler.clock = lambda: now[0]
    model.scheduler.policy = type(model.scheduler.policy)(0, 5.0, True)  # default 5 s, override allowed
    busy = request(["hello", "world"])
    assert model.execute([busy]) is None
    gate.arrived(1)
    short = request(["rag"], timeout_us=100_000)  # its own 0.1 s
    default = request(["fast"])
    assert model.execute([short, default]) is None
    now[0] += 0.5  # past the request's 0.1 s, within the default 5 s
    answered([short])  # expired by the reaper while the only dispatcher is at the encoder
    assert code(short) == TritonError.UNAVAILABLE
    assert short.sender.calls[0].error().message().startswith("Request timeout expired")
    assert not default.sender.done.is_set()
    gate.open.set()
    answered([busy, default])
    assert code(default) is None and code(busy) is None
    model.finalize()
    once([busy, short, default])


def test_unload_answers_everything_waiting_unavailable_and_server_is_stopping_is_unavailable(tmp_path,
                                                                                             monkeypatch) -> None:
    def stopping(ids):
        return InferenceResponse(error=TritonError("Server is stopping"))  # code INTERNAL, as r24.10 hands it

    gate = Gate(stopping)
    model, _ = load_model(tmp_path, monkeypatch, gate, sub_batch_max=1, max_in_flight=1, query_levels=0)
    running = request(["hello"] * 2)
    assert model.execute([running]) is None
    gate.arrived(1)
    waiting = [request(["rag"]), request(["fast", "world"], {"priority_level": 1})]
    assert model.execute(waiting) is None
    s = model.scheduler

    def open_once_unloading() -> None:  # the encoder returns its shutdown error during finalize, after it began
        with s.cond:
            s.cond.wait_for(lambda: s.closing, 30)
        gate.open.set()

    opener = threading.Thread(target=open_once_unloading, daemon=True)
    opener.start()  # (a 0.05 s timer raced finalize: opened first, the dispatcher sent the waiting texts)
    model.finalize()
    opener.join(30)
    answered([running, *waiting])
    once([running, *waiting])
    assert [code(r) for r in (running, *waiting)] == [TritonError.UNAVAILABLE] * 3
    assert "unloading" in waiting[0].sender.calls[0].error().message()


def test_cancellation_is_never_checked_after_the_answer(tmp_path, monkeypatch) -> None:
    """The reaper checks every waiting request while dispatchers answer others: a check and an answer of one
    request never overlap, and no check follows an answer (r24.10 frees the response factory at the answer)."""
    gate = Gate()
    model, _ = load_model(tmp_path, monkeypatch, gate, sub_batch_max=2, max_in_flight=2, cancel_check_s=0.001)
    requests = [request(["hello", "world", "fast", "rag"][: 1 + k % 4] * 2) for k in range(60)]
    for k in range(0, len(requests), 3):
        assert model.execute(requests[k:k + 3]) is None  # 3 requests of 2+ texts: never one sub-batch
    for _ in range(6000):  # bounded (30 s and more) against a hang: until the reaper checked some while all wait
        if sum(r.sender.checks for r in requests) >= 32:
            break
        threading.Event().wait(0.005)
    else:
        raise AssertionError("the reaper never checked the waiting requests")
    gate.open.set()
    answered(requests)
    model.finalize()
    once(requests)


def test_a_bug_in_the_dispatcher_fails_its_sub_batch_and_the_thread_lives(tmp_path, monkeypatch) -> None:
    model, _ = load_model(tmp_path, monkeypatch, ok, sub_batch_max=1, max_in_flight=1, query_levels=0)
    real = model.scheduler._check
    model.scheduler._check = lambda out, rows: (_ for _ in ()).throw(KeyError("a bug after the encoder call"))
    hit = request(["hello", "world"])
    assert model.execute([hit]) is None
    answered([hit])
    assert code(hit) == TritonError.INTERNAL and "a bug after the encoder call" in hit.sender.calls[0].error().message()
    model.scheduler._check = real
    serves(model)
    with model.scheduler.cond:  # the in-flight count comes back (decremented, and notified, after the answer)
        assert model.scheduler.cond.wait_for(lambda: model.scheduler.running == 0, 30)
    model.finalize()
    once([hit])

"""The shipped model.py as a thin adapter: error kinds reach Triton with their codes (fake pb_utils).

The fake triton_python_backend_utils holds only what model.py calls, with python_backend 2.51's
behaviour where it matters: a BLS response error reads code INTERNAL whatever the encoder said, and
responses go through each request's response sender, once, with the FINAL flag (default mode).
"""
from __future__ import annotations

import gc
import importlib.util
import json
import sys
import threading
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
from test_text_core_stages import DIM, tiny_tokenizer

from bge_triton.repository import install_text_endpoint


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, CANCELLED = range(6)

    def __init__(self, message: str, code: int = 1) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array

    def is_cpu(self) -> bool:
        return True


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None) -> None:
        self.output_tensors, self.error_ = list(output_tensors), error

    def has_error(self) -> bool:
        return self.error_ is not None

    def error(self):
        return self.error_


FINAL = 1


# Every violation of the one-answer rule seen by any Sender: model._send catches what send() raises (a closed
# sender must not kill a dispatcher), so an assertion raised there would only be logged; the autouse fixture
# below fails the test that caused one.
VIOLATIONS: list[str] = []


@pytest.fixture(autouse=True)
def one_answer_per_request():
    """Fails the test when any request got a second response or one without the FINAL flag."""
    VIOLATIONS.clear()
    yield
    found = list(VIOLATIONS)
    VIOLATIONS.clear()
    assert not found, f"one answer per request broken: {found}"


class Sender:
    """A response sender: exactly one response, with FINAL, as default mode requires."""

    def __init__(self) -> None:
        self.responses: list[InferenceResponse] = []
        self.done = threading.Event()

    def send(self, response=None, flags=0) -> None:
        problem = ("a second response for one request" if self.done.is_set() else
                   "default mode sends one response with the FINAL flag" if flags != FINAL else None)
        if problem:
            VIOLATIONS.append(problem)
            raise AssertionError(problem)
        self.responses.append(response)
        self.done.set()


class Request:
    def __init__(self, texts, parameters=None, outputs=("embedding", "token_count")) -> None:
        self.tensor = Tensor("text", np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1))
        self.params = json.dumps(parameters or {})
        self.sender = Sender()
        self.outputs = list(outputs)  # Triton fills in every output when the client names none

    def requested_output_names(self) -> list[str]:
        return self.outputs

    def parameters(self) -> str:
        return self.params

    def get_response_sender(self) -> Sender:
        return self.sender


def execute(model, requests: list[Request], timeout_s: float = 10.0) -> list[InferenceResponse]:
    """The responses: returned by execute() (one sub-batch at an idle instance, run inline), or else sent
    through each request's sender by the dispatchers (execute() returns None) - never both."""
    returned = model.execute(requests)
    if returned is not None:
        assert not any(r.sender.done.is_set() for r in requests)
        return returned
    for r in requests:
        assert r.sender.done.wait(timeout_s), "a request was never answered"
    return [r.sender.responses[0] for r in requests]


def idle(model, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until no dispatcher runs and nothing waits: a sender's response comes before its dispatcher
    leaves, so a test that needs the inline path waits for this by progress, not by time."""
    s = model.scheduler
    with s.cond:
        assert s.cond.wait_for(lambda: not s.running and not s.pending, timeout_s), "the scheduler never went idle"


def fake_pb_utils(encoder_answer):
    """A module with the pb_utils names model.py uses; BLS calls answer with encoder_answer(ids)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError, pb.Tensor, pb.InferenceResponse = TritonError, Tensor, InferenceResponse
    pb.TritonModelException = type("TritonModelException", (Exception,), {})
    pb.TRITONSERVER_MEMORY_CPU = 0
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.PreferredMemory = lambda kind, device: (kind, device)
    pb.get_input_tensor_by_name = lambda request, name: request.tensor
    pb.get_output_tensor_by_name = lambda response, name: response.output_tensors[0]
    pb.sent = {}

    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs, preferred_memory) -> None:
            self.model, self.ids = model_name, inputs[0].as_numpy()

        def exec(self):
            return encoder_answer(self.ids)

    pb.alive = weakref.WeakSet()  # the MetricFamily and Metric objects not deleted yet

    class MetricFamily:
        COUNTER = "counter"

        def __init__(self, name, description, kind) -> None:
            self.name = name
            pb.alive.add(self)

        def Metric(self, labels):
            metric = Metric(self.name)
            pb.alive.add(metric)
            return metric

    class Metric:  # holds its family's name, not the family: deleting the family's last reference deletes it
        def __init__(self, name) -> None:
            self.name = name

        def increment(self, value):
            pb.sent[self.name] = pb.sent.get(self.name, 0) + value

    pb.InferenceRequest, pb.MetricFamily = InferenceRequest, MetricFamily
    return pb


def ok(ids: np.ndarray) -> InferenceResponse:
    vecs = np.ones((ids.shape[0], DIM), dtype=np.float32) / np.sqrt(DIM)
    return InferenceResponse([Tensor("embedding", vecs)])


def load_model(tmp_path: Path, monkeypatch, encoder_answer, **params):
    """model.py installed as the exporter does, imported the way the stub does, initialized."""
    version = tmp_path / "m" / "1"
    install_text_endpoint(version)
    (version / "tokenizer").mkdir()
    tiny_tokenizer().save(str(version / "tokenizer" / "tokenizer.json"))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils(encoder_answer))
    monkeypatch.syspath_prepend(str(version))
    spec = importlib.util.spec_from_file_location("m_model", version / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = {"name": f"m{tmp_path.name}", "output": [{"name": "embedding", "dims": [DIM]}],
           "dynamic_batching": {"priority_levels": 2, "default_priority_level": 2},
           "parameters": {k: {"string_value": str(v)} for k, v in {"max_length": 12, **params}.items()}}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(cfg), "model_repository": str(tmp_path / "m"),
                      "model_version": "1"})
    return model, sys.modules["triton_python_backend_utils"]


@pytest.mark.parametrize("message, code", [
    ("Exceeds maximum queue size", TritonError.UNAVAILABLE),
    ("Request timeout expired", TritonError.UNAVAILABLE),
    ("Server is stopping", TritonError.UNAVAILABLE),  # a BLS call at shutdown (r24.10 drops its code)
    ("onnxruntime: invalid index", TritonError.INTERNAL),
])
def test_encoder_errors_keep_overload_as_unavailable(tmp_path, monkeypatch, message: str, code: int) -> None:
    answer = lambda ids: InferenceResponse(error=TritonError(message))  # noqa: E731 - code INTERNAL, as 2.51
    model, _ = load_model(tmp_path, monkeypatch, answer)
    (response,) = execute(model, [Request(["hello world"])])
    assert response.error().code() == code
    assert message in response.error().message() and f"m{tmp_path.name}_onnx" in response.error().message()
    model.finalize()


def test_bad_input_is_invalid_arg_and_the_rest_are_embedded(tmp_path, monkeypatch) -> None:
    model, pb = load_model(tmp_path, monkeypatch, ok)
    responses = execute(model, [Request(["hello"]), Request([" "]), Request(["hello " * 20], {"truncate": False}),
                                Request(["今天", "rag"]), Request(["hello"], {"priority_level": "high"})])
    assert [r.has_error() for r in responses] == [False, True, True, False, True]
    assert {r.error().code() for r in responses if r.has_error()} == {TritonError.INVALID_ARG}
    assert "parameter priority_level='high'" in responses[4].error().message()
    embedding, counts = (t.as_numpy() for t in responses[3].output_tensors)
    assert embedding.shape == (2, DIM) and counts.tolist() == [[4], [3]]  # [CLS] 今 天 [SEP], [CLS] rag [SEP]
    model.finalize()  # sends the summed counters
    assert pb.sent["kit_rejected_requests_total"] == 3 and pb.sent["kit_texts_total"] == 3
    # [CLS] hello [SEP], [CLS] 今 天 [SEP], [CLS] rag [SEP]
    assert pb.sent["kit_padded_tokens_total"] >= pb.sent["kit_real_tokens_total"] == 3 + 4 + 3


def test_finalize_sends_the_counts_and_never_deletes_the_custom_metrics(tmp_path, monkeypatch) -> None:
    """Triton 2.51 gives every instance of a model (a reload's new one included) the same prometheus counter per
    metric name and labels, each MetricFamily counting only its own references: a Metric deleted at unload
    destroyed the counter the next instance still increments (heap corruption in tritonserver). finalize sends
    the counts, then keeps every Metric and MetricFamily alive until the stub exits (never deleted, so it also
    never dies after the stub's shared memory), and the model holds none of them any more."""
    model, pb = load_model(tmp_path, monkeypatch, ok)
    execute(model, [Request(["hello"])])
    families = [m.name for m in pb.alive if isinstance(m, pb.MetricFamily)]
    assert {"kit_texts_total", "kit_queue_duration_us_total"} <= set(families) and len(pb.alive) == 2 * len(families)
    model.finalize()
    assert pb.sent["kit_texts_total"] == 1  # sent at finalize
    assert not model.counters and not model.families
    gc.collect()
    assert len(pb.alive) == 2 * len(families), "a metric object was deleted"


def test_close_drops_every_job_so_their_senders_die_while_the_stub_runs(tmp_path, monkeypatch) -> None:
    """Dead texts left in the pool's buckets held their jobs, and the jobs their response senders, until the
    stub's last collection (a sender that asked is_cancelled() then freed shared memory already gone)."""
    model, _ = load_model(tmp_path, monkeypatch, ok)
    model.finalize()
    assert not model.scheduler.levels and not model.scheduler.jobs and not model.scheduler.deadlines


def test_an_idle_instance_answers_one_sub_batch_inline(tmp_path, monkeypatch) -> None:
    model, _ = load_model(tmp_path, monkeypatch, ok)
    requests = [Request(["hello"]), Request([" "]), Request(["今天", "rag"])]
    responses = model.execute(requests)  # nothing waiting: run in execute, returned, no sender used
    assert responses is not None and not any(r.sender.done.is_set() for r in requests)
    assert [r.has_error() for r in responses] == [False, True, False]
    assert responses[2].output_tensors[1].as_numpy().tolist() == [[4], [3]]
    model.finalize()


def test_the_instance_is_free_at_once_and_a_query_does_not_wait_for_bulk(tmp_path, monkeypatch) -> None:
    """Driven by events only: each step waits (bounded) for the encoder call it expects, so the order holds on a
    busy machine (the earlier version polled with sleeps and raced the bulk dispatcher's first pick)."""
    from test_text_core_stages import VOCAB

    seen: list[np.ndarray] = []
    arrived = threading.Condition()
    gate = threading.Event()

    def slow(ids):
        with arrived:
            seen.append(ids)
            arrived.notify_all()
        assert gate.wait(10), "the test never opened the gate"
        return ok(ids)

    def calls(n: int) -> None:
        with arrived:
            assert arrived.wait_for(lambda: len(seen) >= n, 10), f"{len(seen)} encoder calls, expected {n}"

    model, _ = load_model(tmp_path, monkeypatch, slow, max_in_flight=1, sub_batch_max=1)
    first = [Request(["hello", "world"])]  # two sub-batches: not inline
    assert model.execute(first) is None  # returns while its first sub-batch runs
    calls(1)  # the one bulk dispatcher holds "hello" at the encoder
    second = [Request(["fast"]), Request(["rag"], {"priority_level": 1})]
    assert model.execute(second) is None  # the next Triton batch is taken at once (the scheduler is busy)
    calls(2)  # the query dispatcher sent the query while the bulk dispatcher is still busy
    assert seen[0][0, 1] == VOCAB["hello"] and seen[1][0, 1] == VOCAB["rag"]
    gate.set()
    for r in first + second:
        assert r.sender.done.wait(10)
    assert len(seen) == 4 and {int(ids[0, 1]) for ids in seen[2:]} == {VOCAB["world"], VOCAB["fast"]}
    model.finalize()


def test_a_sent_response_holds_only_the_requested_outputs_referenced_through_send(tmp_path, monkeypatch) -> None:
    """python_backend r24.10 prunes the outputs a request did not ask for inside send() with the GIL released: a
    tensor held by the response alone freed its numpy array there (a corrupted heap in the stub under load). So a
    response sent from a dispatcher holds the requested outputs only, and the adapter still references them."""
    model, _ = load_model(tmp_path, monkeypatch, ok, sub_batch_max=1)
    alive = []

    class Watch(Sender):
        def send(self, response=None, flags=0) -> None:
            self.names = [t.name for t in response.output_tensors]
            refs = [weakref.ref(t) for t in response.output_tensors]
            response.output_tensors.clear()  # as r24.10's prune drops an output (without the GIL): not the last ref
            alive.append(all(ref() is not None for ref in refs))
            super().send(response, flags)

    sdk, both, none = (Request(["hello", "world"], outputs=("embedding",)), Request(["hello", "rag"]),
                       Request(["rag", "world"], outputs=()))
    for r in (sdk, both, none):
        r.sender = Watch()
        assert model.execute([r]) is None  # two sub-batches: sent by a dispatcher
        assert r.sender.done.wait(10)
    assert sdk.sender.names == ["embedding"]  # only what the SDK asks for
    assert both.sender.names == ["embedding", "token_count"]
    assert none.sender.names == ["embedding", "token_count", "timing_us"]  # none named: every output
    assert alive == [True, True, True]  # the adapter still holds every tensor while send() runs
    idle(model)  # a dispatcher that has sent may not yet have left: then execute() would not run inline
    (inline,) = model.execute([Request(["hello"], outputs=("embedding",))])  # returned from execute: the same rule
    assert [t.name for t in inline.output_tensors] == ["embedding"]
    model.finalize()


def test_timing_us_says_where_the_time_went_when_asked(tmp_path, monkeypatch) -> None:
    """timing_us: (tokenization, queue, inference) microseconds, the same on every row of the request; the
    scheduler's clock is a fake that each encoder call advances by 4 ms."""
    now = [1000.0]

    def timed(ids):
        now[0] += 0.004
        return ok(ids)

    model, _ = load_model(tmp_path, monkeypatch, timed, sub_batch_max=1, max_in_flight=1)
    model.scheduler.clock = lambda: now[0]
    (inline,) = execute(model, [Request(["hello"], outputs=("embedding", "timing_us"))])  # one sub-batch: inline
    names = [t.name for t in inline.output_tensors]
    assert names == ["embedding", "timing_us"]
    timing = inline.output_tensors[1].as_numpy()
    assert timing.dtype == np.int64 and timing.shape == (1, 3)
    assert timing[0, 0] >= 0 and timing[0, 1:].tolist() == [0, 4000]  # never waited; one 4 ms encoder call
    (two,) = execute(model, [Request(["hello", "world"], outputs=("timing_us",))])  # two sub-batches, one by one
    timing = two.output_tensors[0].as_numpy()
    assert timing.shape == (2, 3) and (timing == timing[0]).all()  # the request's, on each row
    assert timing[0, 1:].tolist() == [0, 8000]  # its first sub-batch went at once; two 4 ms calls
    (plain,) = execute(model, [Request(["hello"], outputs=("embedding",))])
    assert [t.name for t in plain.output_tensors] == ["embedding"]  # not asked: not sent
    model.finalize()


def test_truncation_direction_reaches_the_tokenizer_per_request(tmp_path, monkeypatch) -> None:
    from test_text_core_stages import VOCAB

    seen: list[np.ndarray] = []

    def record(ids):
        seen.append(ids)
        return ok(ids)

    model, _ = load_model(tmp_path, monkeypatch, record, max_length=4)
    text = "hello world fast rag"
    left, right, bad = (Request([text], {"truncation_direction": "left"}), Request([text]),
                        Request([text], {"truncation_direction": "up"}))
    responses = [execute(model, [r])[0] for r in (left, right, bad)]
    assert seen[0][0, :4].tolist() == [2, VOCAB["fast"], VOCAB["rag"], 3]
    assert seen[1][0, :4].tolist() == [2, VOCAB["hello"], VOCAB["world"], 3]
    assert responses[0].output_tensors[1].as_numpy().tolist() == [[4]]  # token_count after truncation
    assert responses[2].error().code() == TritonError.INVALID_ARG
    assert "parameter truncation_direction='up'" in responses[2].error().message()
    model.finalize()


def test_unknown_encoder_backend_names_the_missing_module(tmp_path, monkeypatch) -> None:
    with pytest.raises(Exception, match="encoder='gpu' needs encoder_gpu.py beside model.py"):
        load_model(tmp_path, monkeypatch, ok, encoder="gpu")



def test_a_second_answer_fails_the_test_even_though_send_swallows_it(tmp_path, monkeypatch) -> None:
    """model._send catches what a sender raises; the Sender's record is what fails a test with a double answer."""
    model, _ = load_model(tmp_path, monkeypatch, ok)
    sender = Sender()
    response = InferenceResponse()
    assert model._send(sender, response) is True
    assert model._send(sender, response) is False  # swallowed by the endpoint, logged
    assert VIOLATIONS == ["a second response for one request"]
    VIOLATIONS.clear()  # seen: this test's own double answer is the point, not a failure
    model.finalize()

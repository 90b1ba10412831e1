"""The shipped model.py as a thin adapter: error kinds reach Triton with their codes (fake pb_utils).

The fake triton_python_backend_utils holds only what model.py calls, with python_backend 2.51's
behaviour where it matters: a BLS response error reads code INTERNAL whatever the encoder said.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from bge_triton.server.repository import install_text_endpoint

from test_text_core_stages import DIM, tiny_tokenizer


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE = range(5)

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


class Request:
    def __init__(self, texts, parameters=None) -> None:
        self.tensor = Tensor("text", np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1))
        self.params = json.dumps(parameters or {})

    def parameters(self) -> str:
        return self.params


def fake_pb_utils(encoder_answer):
    """A module with the pb_utils names model.py uses; BLS calls answer with encoder_answer(ids)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError, pb.Tensor, pb.InferenceResponse = TritonError, Tensor, InferenceResponse
    pb.TritonModelException = type("TritonModelException", (Exception,), {})
    pb.TRITONSERVER_MEMORY_CPU = 0
    pb.PreferredMemory = lambda kind, device: (kind, device)
    pb.get_input_tensor_by_name = lambda request, name: request.tensor
    pb.get_output_tensor_by_name = lambda response, name: response.output_tensors[0]
    pb.sent = {}

    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs, preferred_memory) -> None:
            self.model, self.ids = model_name, inputs[0].as_numpy()

        def exec(self):
            return encoder_answer(self.ids)

        async def async_exec(self):
            return encoder_answer(self.ids)

    class MetricFamily:
        COUNTER = "counter"

        def __init__(self, name, description, kind) -> None:
            self.name = name

        def Metric(self, labels):  # noqa: N802 - pb_utils' name
            family = self

            class Metric:
                def increment(self, value):
                    pb.sent[family.name] = pb.sent.get(family.name, 0) + value

            return Metric()

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
    cfg = {"name": "m", "output": [{"name": "embedding", "dims": [DIM]}],
           "parameters": {k: {"string_value": str(v)} for k, v in {"max_length": 12, **params}.items()}}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(cfg), "model_repository": str(tmp_path / "m"),
                      "model_version": "1"})
    return model, sys.modules["triton_python_backend_utils"]


@pytest.mark.parametrize("message, code", [
    ("Exceeds maximum queue size", TritonError.UNAVAILABLE),
    ("Request timeout expired", TritonError.UNAVAILABLE),
    ("onnxruntime: invalid index", TritonError.INTERNAL),
])
def test_encoder_errors_keep_overload_as_unavailable(tmp_path, monkeypatch, message: str, code: int) -> None:
    answer = lambda ids: InferenceResponse(error=TritonError(message))  # noqa: E731 - code INTERNAL, as 2.51
    model, _ = load_model(tmp_path, monkeypatch, answer)
    (response,) = model.execute([Request(["hello world"])])
    assert response.error().code() == code
    assert message in response.error().message() and "m_onnx" in response.error().message()


def test_bad_input_is_invalid_arg_and_the_rest_are_embedded(tmp_path, monkeypatch) -> None:
    model, pb = load_model(tmp_path, monkeypatch, ok)
    responses = model.execute([Request(["hello"]), Request([" "]), Request(["hello " * 20], {"truncate": False}),
                               Request(["今天", "rag"])])
    assert [r.has_error() for r in responses] == [False, True, True, False]
    assert {r.error().code() for r in responses if r.has_error()} == {TritonError.INVALID_ARG}
    assert responses[3].output_tensors[0].as_numpy().shape == (2, DIM)
    model.finalize()  # sends the summed counters
    assert pb.sent["kit_rejected_requests_total"] == 2 and pb.sent["kit_texts_total"] == 3
    assert pb.sent["kit_padded_tokens_total"] >= pb.sent["kit_real_tokens_total"] == 3 + 4 + 3  # [CLS] hello [SEP], [CLS] 今 天 [SEP], [CLS] rag [SEP]


def test_overlapped_sub_batches_answer_from_a_coroutine(tmp_path, monkeypatch) -> None:
    import asyncio

    model, _ = load_model(tmp_path, monkeypatch, ok, sub_batch_max=1, max_in_flight=2)
    pending = model.execute([Request(["hello"]), Request(["world", "fast"])])
    responses = asyncio.run(pending)
    assert [r.output_tensors[0].as_numpy().shape for r in responses] == [(1, DIM), (2, DIM)]


def test_unknown_encoder_backend_names_the_missing_module(tmp_path, monkeypatch) -> None:
    with pytest.raises(Exception, match="encoder='gpu' needs encoder_gpu.py beside model.py"):
        load_model(tmp_path, monkeypatch, ok, encoder="gpu")


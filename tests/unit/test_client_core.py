"""Unit tests of the client's sans-I/O core: config checks, request building, decoding, planning."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

import bge_triton.client as client
from bge_triton.client.base import BaseEmbeddingClient
from bge_triton.client.core import (
    ClientSettings,
    chunk_slices,
    config_from_json,
    prepare_texts,
    tensor_call,
    text_call,
    validate_model_config,
)
from bge_triton.client.errors import InputError, KitError, ModelConfigError
from bge_triton.client.wire import (
    build_inputs,
    build_outputs,
    decode_embeddings,
    decode_token_counts,
    grpc_request,
    http_request,
)

TEXT_CFG = """
name: "minilm" backend: "python" max_batch_size: 8
input { name: "text" data_type: TYPE_STRING dims: 1 }
output { name: "embedding" data_type: TYPE_FP32 dims: 4 }
parameters { key: "max_length" value { string_value: "128" } }
"""
COUNT_OUT = """
output { name: "token_count" data_type: TYPE_INT32 dims: 1 }
"""
ONNX_CFG = """
name: "minilm_onnx" backend: "onnxruntime" max_batch_size: 3
input { name: "input_ids" data_type: TYPE_INT64 dims: -1 }
input { name: "attention_mask" data_type: TYPE_INT64 dims: -1 }
output { name: "embedding" data_type: TYPE_FP32 dims: 4 }
"""


def cfg(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_public_api_all() -> None:
    assert len(client.__all__) == len(set(client.__all__)), "a name listed twice in __all__"
    star: dict = {}
    exec("from bge_triton.client import *", star)
    assert sorted(k for k in star if not k.startswith("__")) == sorted(client.__all__)
    for name in client.__all__:  # every public name is the kit's own object, not a re-export of a dependency
        obj = getattr(client, name)
        assert getattr(obj, "__module__", "bge_triton").startswith("bge_triton"), (name, obj)
    assert {"EmbeddingClient", "AsyncEmbeddingClient", "InputError", "Overloaded"} <= set(client.__all__)
    # what embed_with_timing returns and what a caller passes as pre-encoded text: public, as the gateway uses them
    from bge_triton.client import core

    assert {"Timing", "Timed", "Utf8"} <= set(client.__all__)
    assert (client.Timing, client.Timed, client.Utf8) == (core.Timing, core.Timed, core.Utf8)
    from bge_triton.errors import Overloaded, ServerUnavailable

    assert client.Overloaded is Overloaded and issubclass(client.Overloaded, ServerUnavailable)


def test_settings_defaults_and_errors() -> None:
    assert ClientSettings().url == "127.0.0.1:8001"
    assert ClientSettings(protocol="http").url == "127.0.0.1:8000"
    assert ClientSettings(mode="tensor", tokenizer="x", model="m").target_model == "m_onnx"
    assert ClientSettings(buckets=(64, 32, 64)).buckets == (32, 64)
    for bad in ({"protocol": "udp"}, {"mode": "tensor"}, {"timeout_s": 0}, {"url": "http://h:1"}, {"buckets": ()}):
        with pytest.raises(InputError):
            ClientSettings(**bad)


def test_validate_text_and_tensor_configs() -> None:
    spec = validate_model_config(cfg(TEXT_CFG), ClientSettings(model="minilm"))
    assert (spec.dim, spec.max_batch_size, spec.max_length, spec.token_counts) == (4, 8, 128, False)
    spec = validate_model_config(cfg(ONNX_CFG), ClientSettings(model="minilm", mode="tensor", tokenizer="t"))
    assert (spec.name, spec.dim, spec.max_batch_size, spec.token_counts) == ("minilm_onnx", 4, 3, True)


def test_validate_token_count_output() -> None:
    """A declared token_count output turns counts on; a wrongly typed one is named."""
    spec = validate_model_config(cfg(TEXT_CFG + COUNT_OUT), ClientSettings(model="minilm"))
    assert spec.token_counts is True
    with pytest.raises(ModelConfigError, match="'token_count' TYPE_INT64"):
        validate_model_config(cfg(TEXT_CFG + COUNT_OUT.replace("TYPE_INT32", "TYPE_INT64")),
                              ClientSettings(model="minilm"))


@pytest.mark.parametrize("edit, fragment", [
    (lambda c: c.input[0].__setattr__("data_type", mc.TYPE_INT64), "TYPE_INT64"),
    (lambda c: c.input[0].__setattr__("name", "sentence"), "no input 'text'"),
    (lambda c: c.output[0].__setattr__("data_type", mc.TYPE_FP16), "TYPE_FP16"),
    (lambda c: c.output[0].dims.append(2), "one fixed dimension"),
    (lambda c: c.__setattr__("max_batch_size", 0), "max_batch_size >= 1"),
    (lambda c: c.__setattr__("name", "other"), "check model="),
])
def test_validate_mismatch_names_the_fix(edit, fragment: str) -> None:
    config = cfg(TEXT_CFG)
    edit(config)
    with pytest.raises(ModelConfigError, match=fragment):
        validate_model_config(config, ClientSettings(model="minilm"))


def test_validate_expected_dim_and_tensor_mode_on_text_model() -> None:
    with pytest.raises(ModelConfigError, match="expects 1024"):
        validate_model_config(cfg(TEXT_CFG), ClientSettings(model="minilm", expected_dim=1024))
    text_as_onnx = cfg(TEXT_CFG)
    text_as_onnx.name = "minilm_onnx"
    with pytest.raises(ModelConfigError, match="input_ids"):
        validate_model_config(text_as_onnx, ClientSettings(model="minilm", mode="tensor", tokenizer="t"))


def test_config_from_http_json() -> None:
    payload = {"name": "minilm", "max_batch_size": 8, "unknown_future_field": 1,
               "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
               "output": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [4]}]}
    assert validate_model_config(config_from_json(payload), ClientSettings(model="minilm")).dim == 4
    with pytest.raises(ModelConfigError):
        config_from_json({"max_batch_size": "many"})


def test_prepare_texts() -> None:
    assert prepare_texts(["a", "b"], "Q:") == ["Q:a", "Q:b"]
    assert prepare_texts(["a"]) == ["a"]
    with pytest.raises(InputError, match="wrap it"):
        prepare_texts("abc")
    with pytest.raises(InputError, match=r"texts\[1\] is empty"):
        prepare_texts(["a", "  "])
    with pytest.raises(InputError, match="bytes"):
        prepare_texts(["a", b"b"])  # type: ignore[list-item]


def test_chunk_slices() -> None:
    assert chunk_slices(0, 4) == []
    assert [(s.start, s.stop) for s in chunk_slices(10, 4)] == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("module", [grpcclient, httpclient])
def test_build_inputs_text_and_tensor(module) -> None:
    call = text_call("m", ["中文", "b"], truncate=False)
    assert call.parameters == {"truncate": False} and call.rows == 2
    (text,) = build_inputs(module, call)
    assert (text.name(), text.datatype(), text.shape()) == ("text", "BYTES", [2, 1])
    ids, mask = build_inputs(module, tensor_call("m_onnx", np.ones((2, 32)), np.ones((2, 32))))
    assert (ids.datatype(), ids.shape(), mask.name()) == ("INT64", [2, 32], "attention_mask")
    assert build_outputs(module)[0].name() == "embedding"


def _grpc_result(arr: np.ndarray) -> grpcclient.InferResult:
    resp = service_pb2.ModelInferResponse(model_name="m")
    out = resp.outputs.add(name="embedding", datatype="FP32", shape=list(arr.shape))
    assert out is not None
    resp.raw_output_contents.append(arr.astype(np.float32).tobytes())
    return grpcclient.InferResult(resp)


def test_decode_checks_shape() -> None:
    arr = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(decode_embeddings(_grpc_result(arr), 2, 4), arr)
    with pytest.raises(KitError, match=r"expected \(3, 4\)"):
        decode_embeddings(_grpc_result(arr), 3, 4)


class _Planner(BaseEmbeddingClient):
    pass


def test_plan_splits_at_max_batch_and_assembles_in_order() -> None:
    c = _Planner(model="minilm", query_instruction="Q:")
    c._accept_config(cfg(TEXT_CFG), None)
    texts = [f"t{i}" for i in range(19)]
    n, plan = c._plan(texts, query=True)
    assert n == 19 and [call.rows for call, _ in plan] == [8, 8, 3]
    first = plan[0][0].inputs[0][2]
    assert first[0, 0] == b"Q:t0"
    parts = [(idx, np.repeat(idx[:, None].astype(np.float32), 4, axis=1)) for _, idx in plan]
    out = c._assemble(n, parts)
    assert out.dtype == np.float32 and out.shape == (19, 4)
    np.testing.assert_array_equal(out[:, 0], np.arange(19))


def test_plan_with_counts_requests_token_count_or_names_the_fix() -> None:
    c = _Planner(model="minilm")
    c._accept_config(cfg(TEXT_CFG), None)
    with pytest.raises(ModelConfigError, match="does not declare the output 'token_count'"):
        c._plan(["a"], query=False, counts=True)
    assert c._plan(["a"], query=False)[1][0][0].outputs == ("embedding",)
    c._accept_config(cfg(TEXT_CFG + COUNT_OUT), None)
    assert c._plan(["a"], query=False, counts=True)[1][0][0].outputs == ("embedding", "token_count")


def test_decode_token_counts_and_assemble() -> None:
    resp = service_pb2.ModelInferResponse(model_name="m")
    resp.outputs.add(name="token_count", datatype="INT32", shape=[3, 1])
    resp.raw_output_contents.append(np.array([[5], [7], [2]], dtype="<i4").tobytes())
    counts = decode_token_counts(grpcclient.InferResult(resp), 3)
    assert counts.dtype == np.int32 and counts.tolist() == [5, 7, 2]
    with pytest.raises(KitError, match=r"expected \(4, 1\)"):
        decode_token_counts(grpcclient.InferResult(resp), 4)
    with pytest.raises(KitError, match="no 'token_count' output"):
        decode_token_counts(_grpc_result(np.zeros((3, 4))), 3)
    c = _Planner(model="minilm")
    c._accept_config(cfg(TEXT_CFG), None)
    out = c._assemble_counts(4, [(np.array([2, 0]), np.array([9, 8])), (np.array([1, 3]), np.array([7, 6]))])
    assert out.tolist() == [8, 7, 9, 6]


def test_spec_needs_connect() -> None:
    with pytest.raises(KitError, match="not connected"):
        _ = _Planner(model="minilm").spec


# Requests the direct builders must encode exactly as tritonclient does: odd texts, a parameter, int32 mask.
WIRE_CALLS = [
    text_call("bge_large_zh", ["今天天气很好", "", "hello\x00world", "向量" * 300], truncate=True),
    text_call("bge_large_zh", ["x"], truncate=False),
    text_call("bge_large_zh", ["with counts"], truncate=True, counts=True),
    dataclasses.replace(text_call("bge_large_zh", ["a query"], truncate=True, counts=True), priority=1),
    tensor_call("bge_large_zh_onnx", np.array([[101, 7592, 102, 0]], dtype=np.int64),
                np.array([[1, 1, 1, 0]], dtype=np.int32)),
]


@pytest.mark.parametrize("call", WIRE_CALLS)
def test_grpc_request_is_the_message_tritonclient_builds(call) -> None:
    """The directly built ModelInferRequest equals tritonclient's, field for field, bytes for bytes."""
    from tritonclient.grpc._utils import _get_inference_request

    want = _get_inference_request(
        model_name=call.model, inputs=build_inputs(grpcclient, call), model_version="", request_id="",
        outputs=build_outputs(grpcclient, call.outputs), sequence_id=0, sequence_start=False, sequence_end=False,
        priority=call.priority,
        timeout=None, parameters=call.parameters or None)
    got = grpc_request(service_pb2, call)
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


def test_grpc_request_rejects_unsupported_parameter_types() -> None:
    call = text_call("m", ["a"], truncate=True)
    bad = type(call)(call.model, call.inputs, {"when": [1, 2]}, call.rows)
    with pytest.raises(KitError, match="'when' has type list"):
        grpc_request(service_pb2, bad)


@pytest.mark.parametrize("call", WIRE_CALLS)
def test_http_request_is_the_body_tritonclient_builds(call) -> None:
    """The directly built HTTP body (JSON header + binary inputs) equals tritonclient.http's, byte for byte."""
    want, want_json = httpclient.InferenceServerClient.generate_request_body(
        build_inputs(httpclient, call), outputs=build_outputs(httpclient, call.outputs),
        parameters=call.parameters or None)
    got, got_json = http_request(call)
    assert got == want and got_json == want_json


def test_http_request_rejects_unsupported_parameter_types() -> None:
    call = text_call("m", ["a"], truncate=True)
    with pytest.raises(KitError, match="'when' has type dict"):
        http_request(type(call)(call.model, call.inputs, {"when": {"a": 1}}, call.rows))


def test_priority_travels_as_triton_queue_priority_only() -> None:
    """A `priority` request parameter (the name Triton reserves) is not sent as a custom one: gRPC carries
    the queue priority as tritonclient does (uint64), HTTP leaves it out of the parameters."""
    call = dataclasses.replace(text_call("m", ["a"], truncate=True), priority=2,
                               parameters={"truncate": True, "priority": 2})
    request = grpc_request(service_pb2, call)
    assert request.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert request.parameters["priority"].uint64_param == 2 and request.parameters["truncate"].bool_param is True
    body, header_length = http_request(call)
    assert b'"parameters":{"truncate":true}' in body[:header_length] and b'"priority"' not in body[:header_length]

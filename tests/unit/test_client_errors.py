"""The SDK classifies a server error by its status code first, by its message only as a fallback."""
from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

from bge_triton.client.errors import (
    InputError,
    KitError,
    ModelConfigError,
    Overloaded,
    ServerUnavailable,
    classify,
    is_retryable,
    status_code,
)

# What the text endpoint answers when its encoder is overloaded (text_core.encoder_error).
ENCODER_OVERLOADED = ("encoder bge_large_zh_onnx is overloaded: Exceeds maximum queue size; retry with backoff, "
                      "or add encoder instances / raise its max_queue_size or queue timeout")


@pytest.mark.parametrize("status, code", [("StatusCode.UNAVAILABLE", "UNAVAILABLE"), ("503", "UNAVAILABLE"),
                                          ("400", "INVALID_ARGUMENT"), ("500", "INTERNAL"),
                                          ("StatusCode.INVALID_ARGUMENT", "INVALID_ARGUMENT"),
                                          ("429", "RESOURCE_EXHAUSTED"), ("504", "DEADLINE_EXCEEDED"),
                                          (None, None), ("", None)])
def test_status_code_reads_grpc_and_http(status, code) -> None:
    assert status_code(InferenceServerException("m", status=status)) == code


@pytest.mark.parametrize("status", ["StatusCode.UNAVAILABLE", "503"])
def test_encoder_overload_behind_the_text_endpoint_is_overloaded(status: str) -> None:
    err = classify(InferenceServerException(ENCODER_OVERLOADED, status=status), "embed")
    assert type(err) is Overloaded and is_retryable(err) and "Exceeds maximum queue size" in str(err)


@pytest.mark.parametrize("status, cls", [
    # the code wins over words in the message
    ("StatusCode.INVALID_ARGUMENT", InputError),
    ("400", InputError),
    ("StatusCode.INTERNAL", Overloaded),  # INTERNAL says nothing: the message decides (a pre-fix server)
    ("500", Overloaded),
    ("StatusCode.UNAVAILABLE", Overloaded),
])
def test_status_decides_before_the_message(status: str, cls: type) -> None:
    msg = "text 0 quotes 'Request timeout expired' from a log"
    assert type(classify(InferenceServerException(msg, status=status), "embed")) is cls


def test_unavailable_without_overload_words_is_server_unavailable_and_retried() -> None:
    err = classify(InferenceServerException("failed to connect to all addresses", status="StatusCode.UNAVAILABLE"))
    assert type(err) is ServerUnavailable and is_retryable(err)
    assert type(classify(InferenceServerException("Too many requests", status="429"))) is Overloaded


def test_internal_failure_is_not_retried() -> None:
    msg = "encoder bge_large_zh_onnx failed: onnxruntime: invalid index"
    for status in ("StatusCode.INTERNAL", "500"):
        err = classify(InferenceServerException(msg, status=status), "embed")
        assert type(err) is KitError and not is_retryable(err) and msg in str(err)


def test_unknown_model_by_code_or_by_message() -> None:
    assert type(classify(InferenceServerException("Request for unknown model: 'x'", status="StatusCode.NOT_FOUND"))) \
        is ModelConfigError
    assert type(classify(InferenceServerException("Request for unknown model: 'x' is not found", status="400"))) \
        is ModelConfigError
    assert type(classify(InferenceServerException("unexpected shape for input 'text'", status="400"))) is InputError

"""The SDK's timing split and truncation side (issue 25 finding 6 / 7): the text call asks for `timing_us` and
sends `truncation_direction` only where the model declares them; the answer's microseconds become a Timing."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.client.base import BaseEmbeddingClient
from bge_triton.client.core import TIMING, TOKEN_COUNT, ClientSettings, Utf8, text_call, validate_model_config
from bge_triton.errors import InputError, KitError, ModelConfigError


def config(timing: bool) -> mc.ModelConfig:
    c = mc.ModelConfig(name="bge_large_zh", max_batch_size=2)
    c.input.add(name="text", data_type=mc.TYPE_STRING, dims=[1])
    c.output.add(name="embedding", data_type=mc.TYPE_FP32, dims=[4])
    c.output.add(name=TOKEN_COUNT, data_type=mc.TYPE_INT32, dims=[1])
    if timing:
        c.output.add(name=TIMING, data_type=mc.TYPE_INT64, dims=[3])
    return c


class Result:
    def __init__(self, arrays: dict[str, Any]) -> None:
        self.arrays = arrays

    def as_numpy(self, name: str) -> Any:
        return self.arrays.get(name)


def client(timing: bool) -> BaseEmbeddingClient:
    c = BaseEmbeddingClient(settings=ClientSettings())
    c._spec = validate_model_config(config(timing), c.settings)
    return c


def test_spec_says_whether_the_endpoint_times_and_cuts_either_side() -> None:
    assert client(True).spec.timings and not client(False).spec.timings
    bad = config(False)
    bad.output.add(name=TIMING, data_type=mc.TYPE_INT32, dims=[3])
    with pytest.raises(ModelConfigError, match="timing_us"):
        validate_model_config(bad, ClientSettings())


def test_plan_asks_for_timing_and_sends_the_direction() -> None:
    c = client(True)
    n, plan = c._plan(["a", "b", "c"], False, True, counts=True, direction="left", timing=True)
    assert n == 3 and len(plan) == 2  # max_batch_size 2
    for call, _ in plan:
        assert call.outputs == ("embedding", TOKEN_COUNT, TIMING)
        assert call.parameters == {"truncate": True, "truncation_direction": "left"}
    _, plain = c._plan(["a"], False, True, counts=True)
    assert plain[0][0].parameters == {"truncate": True} and TIMING not in plain[0][0].outputs
    with pytest.raises(ModelConfigError, match="truncation_direction"):
        client(False)._plan(["a"], False, True, direction="left")
    with pytest.raises(InputError, match="truncation_direction"):
        text_call("m", ["a"], True, direction="middle")


def test_utf8_passes_as_is_and_plain_bytes_are_refused() -> None:
    call = text_call("m", [Utf8("中".encode()), "文"], True)
    assert [bytes(x) for x in call.inputs[0][2].reshape(-1)] == ["中".encode(), "文".encode()]
    c = client(True)
    _, plan = c._plan([Utf8(b"x")], True, True)
    assert bytes(plan[0][0].inputs[0][2][0, 0]).endswith(b"x") and len(bytes(plan[0][0].inputs[0][2][0, 0])) > 1
    with pytest.raises(InputError):
        c._plan([b"x"], False, True)  # type: ignore[list-item]


def test_timing_is_read_and_each_parts_largest_reported() -> None:
    c = client(True)
    _, plan = c._plan(["a", "b", "c"], False, True, counts=True, timing=True)
    first = Result({TIMING: np.array([[100, 2000, 30000], [100, 2000, 30000]], dtype=np.int64)})
    second = Result({TIMING: np.array([[400, 1000, 10000]], dtype=np.int64)})
    parts = [c._decode_timing(plan[0][0], first), c._decode_timing(plan[1][0], second)]
    t = c._timing(parts, 0.05)
    assert t == pytest.approx((0.0004, 0.002, 0.03, 0.05))
    with pytest.raises(KitError, match="timing_us"):
        c._decode_timing(plan[0][0], Result({}))
    assert c._decode_timing(c._plan(["a"], False, True)[1][0][0], first) is None  # not asked: not read

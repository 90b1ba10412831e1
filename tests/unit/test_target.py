"""The measurement core's pure parts: config overrides that change only batching, the restore of the served config
(a fake tritonclient records every load), the admin header per protocol, metrics, batch_stats deltas, the tuner's
pick, and the seed/tune reports written from rows."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.errors import InputError, KitError
from bge_triton.flags import ServerUrl
from bge_triton.loadtest import curves, shapes
from bge_triton.loadtest.core import preferred_sets
from bge_triton.loadtest.target import (
    Target,
    batch_counts,
    batches_text,
    config_diff,
    counts_delta,
    override_config,
    parse_metrics,
)
from bge_triton.loadtest.tune_url import summarise
from bge_triton.repository import DEFAULT_CANONICAL, Batching, load_config


def served() -> mc.ModelConfig:
    """The committed GPU encoder config: two instances, a queue policy, pinned memory (what a user serves)."""
    return load_config(DEFAULT_CANONICAL / "bge_large_zh_onnx")


def test_override_changes_only_the_batching_fields() -> None:
    before = served()
    after = override_config(before, Batching(preferred_batch_sizes=(16, 32), max_queue_delay_us=5000))
    assert list(after.dynamic_batching.preferred_batch_size) == [16, 32]
    assert after.dynamic_batching.max_queue_delay_microseconds == 5000
    assert after.dynamic_batching.default_queue_policy == before.dynamic_batching.default_queue_policy
    assert after.instance_group == before.instance_group and after.optimization == before.optimization
    assert after.max_batch_size == before.max_batch_size
    # nothing else differs: clearing the two fields gives the served config back
    after.dynamic_batching.ClearField("preferred_batch_size")
    after.dynamic_batching.ClearField("max_queue_delay_microseconds")
    before.dynamic_batching.ClearField("preferred_batch_size")
    before.dynamic_batching.ClearField("max_queue_delay_microseconds")
    assert after == before


def test_batch_one_has_no_dynamic_batcher_and_limits_are_the_servers() -> None:
    assert not override_config(served(), Batching(enabled=False)).HasField("dynamic_batching")
    assert override_config(served(), Batching(max_batch_size=8, max_queue_delay_us=0)).max_batch_size == 64
    with pytest.raises(InputError, match="exceed the served max_batch_size 64"):
        override_config(served(), Batching(preferred_batch_sizes=(128,)))


def test_config_diff_names_the_changed_lines_only() -> None:
    diff = config_diff(served(), override_config(served(), Batching(max_queue_delay_us=2000)))
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    assert changed == ["+  max_queue_delay_microseconds: 2000"]
    assert config_diff(served(), served()) == ""


class FakeClient:
    """tritonclient's gRPC client as far as Target uses it: configs served, loads recorded."""

    def __init__(self, cfg: mc.ModelConfig, fail_on: int | None = None) -> None:
        self.cfg, self.loads, self.fail_on = cfg, [], fail_on

    def get_model_config(self, name: str) -> Any:
        return SimpleNamespace(config=self.cfg)

    def load_model(self, name: str, config: str, headers: dict | None = None) -> None:
        self.loads.append((name, json.loads(config), headers))
        if self.fail_on is not None and len(self.loads) == self.fail_on:
            raise RuntimeError("[StatusCode.UNAVAILABLE] This protocol is restricted, expecting header "
                               "'triton-grpc-protocol-triton-admin-key'")
        self.cfg = json_format.ParseDict(json.loads(config), mc.ModelConfig())

    def close(self) -> None:
        pass


def fake_target(client: FakeClient, protocol: str = "grpc", key: str | None = "k" * 20) -> Target:
    return Target(ServerUrl(protocol, "127.0.0.1:1"), "bge_large_zh", "bge_large_zh_onnx", key, "", _client=client)


def delay_of(cfg: dict) -> int:
    return int(cfg.get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0))


@pytest.mark.parametrize("ending", ["ok", "error", "ctrl-c"])
def test_the_served_config_is_loaded_back_however_the_scenario_ends(ending: str) -> None:
    client = FakeClient(served())
    target = fake_target(client)
    make = lambda cfg: override_config(cfg, Batching(max_queue_delay_us=7000))  # noqa: E731
    raised = {"ok": None, "error": RuntimeError, "ctrl-c": KeyboardInterrupt}[ending]
    try:
        with target.overriding("bge_large_zh_onnx", make) as (found, loaded):
            assert delay_of(client.loads[-1][1]) == 7000 and found == served()
            if raised is not None:
                raise raised("stop")
    except (RuntimeError, KeyboardInterrupt):
        assert raised is not None
    assert [delay_of(cfg) for _, cfg, _ in client.loads] == [7000, 0]
    assert client.cfg == served()


def test_keep_leaves_the_candidate_and_no_make_loads_nothing() -> None:
    client = FakeClient(served())
    with fake_target(client).overriding("bge_large_zh_onnx", lambda c: override_config(c, Batching(
            max_queue_delay_us=100)), keep=lambda: True):
        pass
    with fake_target(client).overriding("bge_large_zh_onnx"):
        pass
    assert [delay_of(cfg) for _, cfg, _ in client.loads] == [100]


def test_admin_header_per_protocol_and_a_refusal_names_the_flag() -> None:
    grpc, http = fake_target(FakeClient(served())), fake_target(FakeClient(served()), "http")
    assert grpc.admin_headers == {"triton-grpc-protocol-triton-admin-key": "k" * 20}
    assert http.admin_headers == {"triton-admin-key": "k" * 20}
    assert fake_target(FakeClient(served()), key=None).admin_headers is None
    with pytest.raises(KitError, match="--admin-key"):
        fake_target(FakeClient(served(), fail_on=1)).load("bge_large_zh_onnx", served())


def test_metrics_gauges_and_their_absence() -> None:
    page = ('# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)\nnv_gpu_utilization{gpu_uuid="GPU-a"} 0.5\n'
            'nv_gpu_utilization{gpu_uuid="GPU-b"} 0.7\nnv_cpu_utilization 0.25\n')
    got = parse_metrics(page)
    assert got["gpu"] == pytest.approx(0.6) and got["cpu"] == pytest.approx(0.25)
    assert parse_metrics("nv_inference_count 3\n") == {}
    assert curves.util_text({"gpu_util": math.nan, "cpu_util": math.nan}) == "no metrics"
    assert curves.util_text({"gpu_util": 0.79, "cpu_util": math.nan}) == "GPU 79%"


def test_batch_stats_deltas() -> None:
    def stats(pairs: dict[int, int]) -> dict:
        return {"model_stats": [{"batch_stats": [{"batch_size": str(k), "compute_infer": {"count": str(v)}}
                                                 for k, v in pairs.items()]}]}

    before, after = batch_counts(stats({1: 5, 32: 2})), batch_counts(stats({1: 5, 16: 3, 32: 6}))
    assert counts_delta(before, after) == {16: 3, 32: 4}
    assert batches_text({16: 3, 32: 4}) == "32x4 16x3 (avg 25.1)"
    assert batches_text({}) == "-"


def rows_for(name: str, delay: int, p99s: list[float], errors: int = 0, reload_errors: int = 0) -> list[dict]:
    base = {"candidate": name, "delay_us": delay, "preferred": "none"}
    out = [{**base, "kind": "reload", "sent": 10, "errors": reload_errors, "n": 10 - reload_errors,
            "p99_ms": 1.0, "throughput": 10.0, "rate": 10.0}]
    for k, p99 in enumerate(p99s):
        out.append({**base, "kind": "steady", "rate": 10.0 * (k + 1), "throughput": 10.0 * (k + 1), "sent": 100,
                    "errors": errors, "n": 100 - errors, "p99_ms": p99})
    return out


def test_the_pick_is_the_lowest_worst_p99_within_the_slo_and_ties_go_to_the_shorter_delay() -> None:
    rows = (rows_for("a", 0, [10.0, 30.0]) + rows_for("b", 2000, [12.0, 29.8]) + rows_for("c", 5000, [9.0, 80.0])
            + rows_for("d", 100, [5.0, 6.0], reload_errors=5))
    summary = {c["candidate"]: c for c in summarise(rows, slo_ms=50.0, max_error_rate=0.01)}
    assert summary["a"]["picked"] and not summary["b"]["picked"]  # 29.8 is within 2% of 30: the shorter delay
    assert not summary["c"]["meets_slo"]  # its worst p99 misses the SLO
    assert not summary["d"]["meets_slo"] and summary["d"]["reload_errors"] == 5  # lost requests in the reload
    assert not any(c["picked"] for c in summarise(rows, slo_ms=1.0, max_error_rate=0.01))


def test_preferred_sets_and_the_shared_shape_curve() -> None:
    assert preferred_sets("none;16,32;32") == ((), (16, 32), (32,))
    with pytest.raises(InputError, match="--preferred"):
        preferred_sets("a,b")
    p = shapes.ShapeParams(peak=40, duration_s=100)
    assert shapes.level("tidal", 0.0) == pytest.approx(0.2) and shapes.level("tidal", 0.5) == pytest.approx(1.0)
    assert [shapes.users_at("tidal", t, p) for t in (0, 50)] == [round(40 * shapes.level("tidal", f)) for f in
                                                                 (0.0, 0.5)]


def test_a_refused_override_restores_nothing_the_served_model_kept_serving() -> None:
    client = FakeClient(served(), fail_on=1)
    with pytest.raises(KitError, match="--admin-key"):
        with fake_target(client).overriding("bge_large_zh_onnx", lambda c: override_config(c, Batching(
                max_queue_delay_us=100))):
            raise AssertionError("the scenario must not run on a refused override")
    assert len(client.loads) == 1 and client.cfg == served()


def test_a_stop_request_interrupts_as_ctrl_c_does() -> None:
    import os
    import signal

    from bge_triton.loadtest.target import stop_like_ctrl_c

    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop_like_ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next bytecode
    finally:
        signal.signal(signal.SIGTERM, previous)

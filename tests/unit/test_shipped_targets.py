"""Issue 14's targets as pure logic: verdicts, the pick, the ideal rate, host sizing, candidates, config writes."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from bge_triton.errors import ModelConfigError
from bge_triton.loadtest import costmodel, targets
from bge_triton.loadtest.shipped import Candidate, pair_candidates, write_pick
from bge_triton.repository import (
    DEFAULT_CANONICAL,
    batching_of,
    load_config,
    text_settings,
    update_text_settings_in_place,
)


def _rows(text_p50: float, text_p99: float, direct_p50: float, direct_p99: float, text_rate: float, tensor_rate: float):
    return ({"p50_ms": text_p50, "p99_ms": text_p99}, [{"throughput": text_rate, "load": "C=128"}],
            {"p50_ms": direct_p50, "p99_ms": direct_p99}, [{"throughput": tensor_rate, "load": "C=128"}])


def test_verdicts_pass_and_fail_at_the_limits():
    low, peak, direct, tensor = _rows(10.0, 19.0, 8.5, 16.0, 900.0, 1000.0)
    vs = targets.verdicts(low, peak, direct, tensor, t1_ms=5.5, ideal=1000.0)
    assert [v["pass"] for v in vs] == [True, True, True, True, True]  # 1.5, 4.5, 3.0 ms; 0.90; 0.90 >= 0.85
    assert [round(v["measured"], 3) for v in vs] == [1.5, 4.5, 3.0, 0.9, 0.9]
    low, peak, direct, tensor = _rows(15.3, 30.0, 9.0, 16.0, 400.0, 1000.0)  # the committed pair of issue 14
    vs = targets.verdicts(low, peak, direct, tensor, t1_ms=6.5, ideal=1000.0)
    assert [v["pass"] for v in vs] == [False, False, False, False, False]


def test_verdicts_fail_on_missing_measurements():
    low, peak, direct, tensor = _rows(math.nan, math.nan, 8.0, 9.0, 0.0, 0.0)
    assert not any(v["pass"] for v in targets.verdicts(low, peak, direct, tensor, 6.0, 1000.0))


def test_pick_most_passes_then_the_first_listed():
    two = [{"pass": True}, {"pass": True}, {"pass": False}]
    three = [{"pass": True}] * 3
    assert targets.pick([("a", two), ("b", three), ("c", three)]) == "b"
    assert targets.pick([("a", two), ("b", two)]) == "a"
    assert targets.pick([]) is None


def test_ideal_rate_and_cpu_arithmetic():
    cost = costmodel.CostModel(6260.0, 9.96)
    assert targets.ideal_rate(cost, 64, 50.0) == pytest.approx(64000.0 / (6.26 + 9.96e-3 * 64 * 50))
    assert targets.cpu_s_per_1000(0.5, 1000.0) == pytest.approx(0.5)
    assert math.isnan(targets.cpu_s_per_1000(0.5, 0.0))


def test_instances_for_host_ceil_and_caps():
    assert targets.instances_for_host(1300.0, 500.0) == 3
    assert targets.instances_for_host(1300.0, 5000.0) == 2  # the overlap floor
    assert targets.instances_for_host(1300.0, 5000.0, floor=1) == 1
    assert targets.instances_for_host(1e6, 10.0, host_cores=16, reserved_cores=4) == 12
    with pytest.raises(ValueError, match="measure it first"):
        targets.instances_for_host(1300.0, 0.0)


def test_candidate_parse_and_its_overrides():
    assert Candidate.parse("committed").batching() is None and Candidate.parse("committed").text_params() == {}
    c = Candidate.parse("delay=0,preferred=none,split=628,mif=2,ti=3")
    assert (c.delay_us, c.preferred, c.text_instances) == (0, (), 3)
    assert c.text_params() == {"split_overhead_tokens": "628", "max_in_flight": "2"}
    assert Candidate.parse("delay=5000,preferred=16/32").batching().preferred_batch_sizes == (16, 32)
    with pytest.raises(SystemExit, match="unknown key"):
        Candidate.parse("window=3")


def test_pair_grid_parses_back_into_candidates():
    grid = pair_candidates("0,5000", "none;16,32", "64,628", "1,2")
    assert grid[0] == "committed" and len(grid) == 1 + 16 and len(set(grid)) == len(grid)
    parsed = [Candidate.parse(g) for g in grid[1:]]
    assert {(c.delay_us, c.preferred) for c in parsed} == {(0, ()), (0, (16, 32)), (5000, ()), (5000, (16, 32))}


def test_write_pick_updates_both_configs_through_the_schema(tmp_path: Path):
    for name in ("bge_large_zh", "bge_large_zh_onnx"):
        shutil.copytree(DEFAULT_CANONICAL / name, tmp_path / name, ignore=shutil.ignore_patterns("*.py", "tokenizer"))
    before_txt = load_config(tmp_path / "bge_large_zh")
    write_pick(Candidate.parse("delay=1000,preferred=8,split=500,mif=2,ti=5"), tmp_path)
    enc, txt = load_config(tmp_path / "bge_large_zh_onnx"), load_config(tmp_path / "bge_large_zh")
    assert batching_of(enc).max_queue_delay_us == 1000 and batching_of(enc).preferred_batch_sizes == (8,)
    s = text_settings(txt)
    assert (s.split_overhead_tokens, s.max_in_flight, txt.instance_group[0].count) == (500, 2, 5)
    assert txt.dynamic_batching == before_txt.dynamic_batching  # priority levels and queue policy kept
    assert (tmp_path / "bge_large_zh" / "config.pbtxt").read_text(encoding="utf-8").startswith("#")  # header kept


def test_update_text_settings_rejects_unknown_keys_and_bad_counts(tmp_path: Path):
    shutil.copytree(DEFAULT_CANONICAL / "bge_large_zh", tmp_path / "t", ignore=shutil.ignore_patterns("*.py",
                                                                                                      "tokenizer"))
    with pytest.raises(ModelConfigError, match="not text endpoint settings"):
        update_text_settings_in_place(tmp_path / "t", window_ms=3)
    with pytest.raises(ModelConfigError, match="instance count 0"):
        update_text_settings_in_place(tmp_path / "t", instances=0)


def test_planned_rate_is_the_ideal_for_equal_lengths_and_less_with_padding():
    cost = costmodel.CostModel(6260.0, 9.96)
    one_run = lambda lengths, *a: [(list(range(len(lengths))), -(-max(lengths) // 8) * 8)]  # noqa: E731
    assert targets.planned_rate([64] * 10, 64, cost, one_run) == pytest.approx(targets.ideal_rate(cost, 64, 64.0))
    mixed = targets.planned_rate([16, 256], 64, cost, one_run)  # everything padded to 256
    assert mixed < targets.ideal_rate(cost, 64, 136.0) / 1.5

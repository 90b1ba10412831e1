"""`bge-triton bench ab` (loadtest/ab.py), its pure parts: variant rendering, target verdicts, the A/B table."""
from __future__ import annotations

import argparse
import math

import pytest

from bge_triton.loadtest import ab
from bge_triton.loadtest.commands import BENCH
from bge_triton.server.repository import DEFAULT_CANONICAL, TritonMode, load_config, text_settings

COMMITTED = load_config(DEFAULT_CANONICAL / "bge_large_zh")


def test_pool_renders_the_committed_config_and_triton_the_batcher_mode() -> None:
    pool = ab.POOL.render(COMMITTED)
    assert pool == COMMITTED and text_settings(pool).scheduler == "pool"
    triton = ab.TRITON.render(COMMITTED)
    assert triton.parameters["scheduler"].string_value == "triton"
    assert triton.max_batch_size == TritonMode().max_batch_size != COMMITTED.max_batch_size
    assert triton.instance_group[0].count == TritonMode().instances  # the bench loads both with equal counts
    db = triton.dynamic_batching
    assert db.max_queue_delay_microseconds == 0 and db.priority_levels == 2
    assert db.priority_queue_policy[1].max_queue_size == TritonMode().query_max_queue_size
    assert COMMITTED.max_batch_size == 128  # the render is a copy: the committed config is untouched
    assert text_settings(triton).scheduler == "triton"


def test_variant_items_go_to_the_triton_knobs_the_params_or_the_fix() -> None:
    triton = ab.TRITON.with_items(["max_batch_size=1024", "query_token_budget=1024"])
    assert triton.triton == TritonMode(max_batch_size=1024)
    assert triton.text_params() == {"query_token_budget": "1024"}
    assert triton.render(COMMITTED).max_batch_size == 1024
    pool = ab.POOL.with_items(["age_bound_s=0.5"], fix=True).with_items(["max_in_flight=3"])
    assert pool.text_params() == {"max_in_flight": "3", "age_bound_s": "0.5"}
    assert pool.text_params(fix=False) == {"max_in_flight": "3"}  # the fairness run without the fix
    assert "age_bound_s=0.5" in pool.describe() and "age_bound_s" not in pool.describe(fix=False)
    assert pool.triton is None and "scheduler=triton, max_batch_size=1024" in triton.describe()
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        ab.POOL.with_items(["age_bound_s"])


def test_verdicts_at_the_limits_and_without_a_value() -> None:
    assert ab.verdict(0.85, ">=", 0.85) == "PASS" and ab.verdict(0.849, ">=", 0.85) == "FAIL"
    assert ab.verdict(1.5, "<=", 1.5) == "PASS" and ab.verdict(1.51, "<=", 1.5) == "FAIL"
    assert ab.verdict(math.nan, "<=", 1.5) == "n/a"
    assert ab.verdict(0.3, None, math.nan) == ""  # reported, no target


def rows(variant: str, peak: tuple[float, ...] = (900.0, 1100.0, 1000.0)) -> list[dict]:
    out = [{"variant": variant, "phase": "peak", "throughput": t, "server_cores": 1.1, "load": f"C={c}"}
           for t, c in zip(peak, (128, 512, 1024), strict=True)]
    out += [{"variant": variant, "phase": "quiet", "p50_ms": 10.0},
            {"variant": variant, "phase": "quiet_direct", "p50_ms": 9.0},
            {"variant": variant, "phase": "query_quiet", "p99_ms": 12.0},
            {"variant": variant, "phase": "query_flood", "p99_ms": 30.0},
            {"variant": variant, "phase": "drain", "texts_per_s": 1500.0},
            {"variant": variant, "phase": "fair", "p50_ms": 1000.0, "p99_ms": 1400.0, "throughput": 38.0},
            {"variant": variant, "phase": "fair_unfixed", "p50_ms": 900.0, "p99_ms": 2000.0, "throughput": 40.0}]
    return out


def test_metrics_come_from_the_rows_with_the_peak_as_saturation() -> None:
    m = ab.metrics_of(rows("pool") + rows("triton", (500.0, 600.0, 700.0)), "pool", 1241.0, 2000.0)
    assert m["peak_vs_ideal"] == pytest.approx(1100.0 / 1241.0)  # the best point of the sweep, not the last
    assert m["quiet_p50_vs_direct_ms"] == pytest.approx(1.0)
    assert m["flood_p99_ratio"] == pytest.approx(2.5)
    assert m["drain_vs_ideal"] == pytest.approx(0.75)
    assert m["cpu_ms_per_text"] == pytest.approx(1000.0 * 1.1 / 1100.0)
    assert m["fair_p99_p50"] == pytest.approx(1.4) and m["fair_vs_unfixed"] == pytest.approx(0.95)
    assert ab.metrics_of(rows("pool"), "triton", 1241.0, 2000.0)["peak_vs_ideal"] != \
        ab.metrics_of(rows("pool"), "triton", 1241.0, 2000.0)["peak_vs_ideal"]  # no rows: nan, not a number


def test_the_peak_reads_only_points_served_without_errors() -> None:
    """A closed loop whose refusals come back at once measures speed at refusing: such a point is not the peak."""
    refused = rows("triton", (500.0, 600.0, 700.0))
    refused[2].update(throughput=2000.0, n=5000, errors=4865)  # C=1024 past the queue limit
    refused[1].update(n=1000, errors=10)  # 1%: still clean
    m = ab.metrics_of(refused, "triton", 1000.0, 2000.0)
    assert m["peak_vs_ideal"] == pytest.approx(0.6)
    assert ab.clean({"n": 1000, "errors": 10}) and not ab.clean({"n": 1000, "errors": 11})
    assert ab.clean({"n": 0, "errors": 0}) and not ab.clean({"n": 0, "errors": 1})
    assert ab.clean({"n": 1000, "errors": 216, "unanswered": 216})  # still running at the grace's end: slow, not failed
    all_refused = [dict(r, errors=1000, n=10) if r["phase"] == "peak" else r for r in refused]
    assert math.isnan(ab.metrics_of(all_refused, "triton", 1000.0, 2000.0)["peak_vs_ideal"])


def test_a_mode_without_a_fix_has_no_throughput_comparison() -> None:
    only_fixed = [r for r in rows("triton") if r["phase"] != "fair_unfixed"]
    m = ab.metrics_of(only_fixed, "triton", 1241.0, 2000.0)
    assert math.isnan(m["fair_vs_unfixed"]) and m["fair_p99_p50"] == pytest.approx(1.4)


def test_the_table_has_a_row_per_target_with_verdicts_and_the_better_mode() -> None:
    metrics = {"pool": ab.metrics_of(rows("pool"), "pool", 1241.0, 2000.0),
               "triton": ab.metrics_of(rows("triton", (500.0, 600.0, 700.0)), "triton", 1241.0, 2000.0)}
    lines = ab.ab_table(metrics)
    assert len(lines) == 2 + len(ab.TARGETS)
    assert lines[0] == "| target | limit | pool | triton | better |"
    peak = next(line for line in lines if line.startswith("| peak texts/s"))
    assert peak == "| peak texts/s / cost model's ideal | >= 0.85 | 0.89 PASS | 0.56 FAIL | pool |"
    flood = next(line for line in lines if line.startswith("| query p99 under"))
    assert "2.50 FAIL" in flood and flood.endswith("| tie |")  # equal values: neither wins
    cpu = next(line for line in lines if line.startswith("| server CPU-ms"))
    assert "| - |" in cpu and "PASS" not in cpu  # reported, no target


def test_better_knows_which_way_each_target_points() -> None:
    assert ab.better("peak_vs_ideal", {"pool": 0.9, "triton": 0.8}) == "pool"
    assert ab.better("quiet_p50_vs_direct_ms", {"pool": 2.0, "triton": 1.0}) == "triton"
    assert ab.better("cpu_ms_per_text", {"pool": 1.0, "triton": 1.01}) == "tie"
    assert ab.better("fair_p99_p50", {"pool": 1.2, "triton": math.nan}) == "-"


def test_the_drain_row_counts_texts_served_until_the_last_ok_answer_and_sheds_by_cause() -> None:
    outcomes = [(0.5, ""), (2.0, ""), (4.0, ""),
                (0.01, "Overloaded: (Exceeds maximum queue size: 2030); raise max_queue_size or queue timeout"),
                (5.0, "ServerUnavailable: Request timeout expired"), (5.1, "InternalError: boom")]
    row = ab.drain_row(outcomes, 64)
    assert row["texts_served"] == 192 and row["drain_s"] == 4.0 and row["texts_per_s"] == pytest.approx(48.0)
    assert row["failed"] == 3 and row["shed"] == "1 queue full, 1 timed out, 1 other"
    assert row["last_answer_s"] == 5.1 and row["first_error"].startswith("Overloaded: (Exceeds")
    nothing = ab.drain_row([(0.1, "ServerUnavailable: Exceeds maximum queue size")], 64)
    assert nothing["texts_served"] == 0 and math.isnan(nothing["texts_per_s"])


def test_select_by_tokens_keeps_the_length_window_or_names_the_shortfall() -> None:
    texts, lengths = ["a", "b", "c", "d"], [100, 170, 150, 230]
    assert ab.select_by_tokens(texts, lengths, 120, 220, 2) == ["b", "c"]
    with pytest.raises(ValueError, match="only 2 texts of 120-220 tokens"):
        ab.select_by_tokens(texts, lengths, 120, 220, 3)


def test_the_scenario_is_in_the_command_tree() -> None:
    module, function, what = BENCH["ab"]
    assert module == "bge_triton.loadtest.ab" and function == "main" and "issue 24" in what
    assert callable(getattr(ab, function))

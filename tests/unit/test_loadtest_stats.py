"""Unit tests of the load-test arithmetic: percentiles, Triton stats deltas, shapes, cost-model fit, tuner pick."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bge_triton.errors import InputError
from bge_triton.loadtest import costmodel, shapes
from bge_triton.loadtest.stats import flatten_stats, histogram_percentile, percentile, stats_delta, summarize
from bge_triton.loadtest.tune import choose


def _stats(inference: int, execs: int, ok: int, queue_ns: int, infer_ns: int, fail: int = 0) -> dict:
    return {"model_stats": [{"name": "m", "version": "1", "inference_count": inference, "execution_count": execs,
                             "inference_stats": {"success": {"count": ok, "ns": 0}, "fail": {"count": fail, "ns": 0},
                                                 "queue": {"count": ok, "ns": queue_ns},
                                                 "compute_input": {"count": ok, "ns": 0},
                                                 "compute_infer": {"count": ok, "ns": infer_ns},
                                                 "compute_output": {"count": ok, "ns": 0}}}]}


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    xs = list(rng.exponential(10.0, 997))
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert math.isnan(percentile([], 50))


def test_histogram_percentile_is_the_same_definition():
    rng = np.random.default_rng(2)
    for _ in range(50):
        hist = {int(v): int(n) for v, n in zip(rng.integers(0, 400, 6), rng.integers(0, 9, 6), strict=False)}
        expanded = [float(v) for v, n in hist.items() for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 100):
            got, want = histogram_percentile(hist, q), percentile(expanded, q)
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-9)
    assert histogram_percentile({10: 1, 20: 1}, 50) == 15.0  # interpolated, not nearest-rank


def test_summarize_small():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert (s.count, s.avg_ms, s.p50_ms, s.max_ms) == (4, 2.5, 2.5, 4.0)
    assert summarize([]).count == 0


def test_stats_delta_batch_queue_compute():
    before = flatten_stats(_stats(100, 10, 100, 5_000_000, 200_000_000))
    # 64 more requests in 4 batches of 16; 64 ms queue in all (1 ms each); each request sees its batch's 8 ms
    after = flatten_stats(_stats(164, 14, 164, 69_000_000, 712_000_000, fail=2))
    d = stats_delta(before, after)
    assert d.requests == 64 and d.executions == 4 and d.failures == 2
    assert d.avg_batch == pytest.approx(16.0)
    assert d.queue_ms == pytest.approx(1.0)
    assert d.compute_ms == pytest.approx(8.0)


def test_stats_delta_sums_versions_and_is_zero_safe():
    two = _stats(10, 5, 10, 0, 0)
    two["model_stats"].append(two["model_stats"][0])
    assert flatten_stats(two)["inference_count"] == 20
    d = stats_delta(flatten_stats(two), flatten_stats(two))
    assert d.requests == 0 and math.isnan(d.avg_batch) and math.isnan(d.queue_ms)


@pytest.mark.parametrize("shape", shapes.SHAPES)
def test_shapes_stay_in_range_and_end(shape):
    p = shapes.ShapeParams(peak=40, duration_s=100)
    users = [shapes.users_at(shape, t, p) for t in range(100)]
    assert all(1 <= u <= 40 for u in users)
    assert max(users) == 40
    assert shapes.users_at(shape, 100, p) is None


def test_shape_details():
    p = shapes.ShapeParams(peak=40, duration_s=100, steps=4)
    assert [shapes.users_at("step", t, p) for t in (0, 25, 50, 99)] == [10, 20, 30, 40]
    assert shapes.users_at("tidal", 0, p) == 8 and shapes.users_at("tidal", 50, p) == 40  # night trough, midday crest
    assert shapes.users_at("spike", 10, p) == 8 and shapes.users_at("spike", 55, p) == 40
    assert shapes.spawn_rate("spike", p, 1) == 40
    with pytest.raises(InputError, match="unknown shape"):
        shapes.users_at("sawtooth", 1, p)


def test_costmodel_default_is_the_line_through_the_seed_rows():
    # the two published rows solved by hand: one batch of B takes B / QPS seconds = a + b * B * 64
    t1, t32 = 1e6 / 145.0, 32e6 / 1200.0  # us per batch
    b = (t32 - t1) / (32 * 64 - 1 * 64)
    a = t1 - 64 * b
    m = costmodel.DEFAULT
    assert m.a_us == pytest.approx(a, rel=1e-9) and m.b_us == pytest.approx(b, rel=1e-9)
    assert m.rmse_ms == pytest.approx(0.0, abs=1e-9)  # two points, two parameters: an exact fit


def test_costmodel_fit_clamps_to_non_negative_costs():
    falling = [costmodel.ProfilePoint(1, 64, 3.0), costmodel.ProfilePoint(8, 64, 2.0)]  # slope < 0
    m = costmodel.fit(falling)
    assert (m.a_us, m.b_us) == (pytest.approx(2500.0), 0.0)  # flat: the mean cost
    steep = [costmodel.ProfilePoint(1, 10, 0.1), costmodel.ProfilePoint(10, 10, 2.0)]  # intercept < 0
    m = costmodel.fit(steep)
    assert m.a_us == 0.0 and m.b_us == pytest.approx((10 * 100 + 100 * 2000) / (10 ** 2 + 100 ** 2))


def test_costmodel_fit_recovers_noisy_profile():
    rng = np.random.default_rng(1)
    pts = [costmodel.ProfilePoint(b, n, (2000 + 3.0 * b * n) / 1000 * (1 + rng.normal(0, 0.01)))
           for b in (1, 2, 4, 8, 16, 32) for n in (16, 64, 128)]
    m = costmodel.fit(pts)
    assert m.a_us == pytest.approx(2000, rel=0.05) and m.b_us == pytest.approx(3.0, rel=0.03)
    with pytest.raises(InputError, match="two or more"):
        costmodel.fit([costmodel.ProfilePoint(4, 16, 1.0), costmodel.ProfilePoint(2, 32, 1.1)])


def _row(delay, pref, goodput, p99, errors=0, n=1000):
    return {"delay_us": delay, "preferred": pref, "goodput": goodput, "p99_ms": p99, "errors": errors, "n": n,
            "p50_ms": p99 / 2, "queue_ms": 1.0, "compute_ms": 2.0, "avg_batch": 4.0}


def test_tuner_pick_rules():
    rows = [_row(0, (), 500, 40), _row(5000, (), 505, 35), _row(20000, (), 520, 80),
            _row(2000, (32,), 300, 20, errors=50)]
    best = choose(rows, slo_p99_ms=50)
    assert (best["delay_us"], best["preferred"]) == (5000, ())  # 520 breaks the SLO; 500 and 505 tie -> lower p99
    assert [r["meets_slo"] for r in rows] == [True, True, False, False]
    assert choose(rows, slo_p99_ms=10) is None


def test_tuner_combines_rounds_by_median():
    from bge_triton.loadtest.tune import combine

    rounds = [_row(0, (), 100, 30), _row(0, (), 110, 300), _row(0, (), 90, 40)]
    row = combine(rounds)
    assert row["p99_ms"] == 40 and row["goodput"] == pytest.approx(100) and row["n"] == 3000


def test_tune_report_names_its_command_the_pick_and_every_candidate(tmp_path):
    from bge_triton.loadtest import tune

    s = tune.parse_args(["--slo-p99-ms", "50", "--rate", "600", "--out", str(tmp_path)])
    run = tune.TuneRun(s, machine={"cores": 2, "server": "tritonserver", "load": (1.0, 0.5, 0.25)})
    run.rows = [{"delay_us": d, "preferred": p, "rate": 600.0, "goodput": g, "p50_ms": 10.0, "p99_ms": p99, "n": 100,
                 "errors": 0, "avg_batch": 2.0, "queue_ms": 1.0, "compute_ms": 5.0, "meets_slo": False, "picked": False}
                for d, p, g, p99 in ((0, (), 590.0, 40.0), (5000, (16, 32), 600.0, 80.0))]
    run.picked = choose(run.rows, 50.0)
    run.picked["picked"] = True
    md, csv_path, png = tune.write_tune(run, tmp_path)
    text = md.read_text()
    assert text.startswith(f"<!-- generated by `{s.command}`") and "Load average at start 1.00 / 0.50 / 0.25" in text
    assert "Pick: **delay 0 us, preferred none**" in text and "| 5000 | [16, 32] | 600 |" in text
    assert csv_path.read_text().startswith(f"# generated by `{s.command}`") and png.stat().st_size > 1000

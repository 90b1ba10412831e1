"""Unit tests of the soak's arithmetic (loadtest/soak.py, its recovery windows in loadtest/faults.py) on made-up runs:
durations, the event plan, recovery times, per-minute rows and RSS drift."""
from __future__ import annotations

import math

import pytest

from bge_triton.errors import InputError
from bge_triton.loadtest import faults
from bge_triton.loadtest import soak as sa


def steady(start: float, end: float, latency: float, rate: float = 50.0, outcome: str = "ok") -> list[sa.Shot]:
    """Requests every 1/rate s in [start, end), each answered after `latency` s with `outcome`."""
    n = int(round((end - start) * rate))
    return [sa.Shot(start + k / rate, start + k / rate + latency, outcome) for k in range(n)]


@pytest.mark.parametrize("text, seconds", [("20m", 1200.0), ("40s", 40.0), ("1h", 3600.0), ("90", 90.0),
                                           ("1m30s", 90.0), ("2.5m", 150.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert sa.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "twenty", "20x", "-5m", "10s"])
def test_parse_duration_rejects_with_the_format(text: str) -> None:
    with pytest.raises(InputError, match="--duration"):
        sa.parse_duration(text)


def test_plan_spreads_the_three_faults_and_compresses_the_spike() -> None:
    assert sa.plan_events(1200.0) == [("kill9_server", 300.0, 0.0), ("kill9_stub", 600.0, 0.0),
                                      ("overload_spike", 900.0, 30.0)]
    short = sa.plan_events(40.0)
    assert [at for _, at, _ in short] == [10.0, 20.0, 30.0] and short[2][2] == pytest.approx(3.2)
    assert tuple(kind for kind, _, _ in short) == sa.EVENT_KINDS


def test_window_p99_counts_failures_as_infinitely_slow() -> None:
    shots = steady(0, 2, 0.05)
    assert faults.window_p99s(shots, 0, 2, 1) == [(pytest.approx(0.05), 100)]
    one_bad = shots[:-1] + [sa.Shot(shots[-1].sched, shots[-1].done, "ServerUnavailable")]
    assert faults.window_p99s(one_bad, 0, 2, 1)[0][0] == math.inf  # a failure reaches into the top 1% of 100
    assert math.isnan(faults.window_p99s(shots, 5, 2, 1)[0][0])


def test_recovery_after_an_outage() -> None:
    # calm 50 ms; the server dies at t=10; requests sent in [10, 13) fail; answers slow (400 ms) until t=17
    shots = steady(0, 10, 0.05) + steady(10, 13, 0.01, outcome="ServerUnavailable") + steady(13, 17, 0.4) \
        + steady(17, 40, 0.05)
    base, thr = faults.calm_p99(shots, 10)
    assert base == pytest.approx(0.05) and thr == pytest.approx(0.1)
    assert faults.p99_back_after(shots, 10.0, thr, 2.0, until=40.0) == pytest.approx(8.0)  # windows from 18 s are calm
    assert faults.p99_back_after(shots, 10.0, thr, 2.0, until=20.0) is None  # too little calm before `until`
    kill = {"kind": "kill9_server", "planned_s": 10.0, "at_s": 10.0, "length_s": 0.0, "pid": 7}
    res = {"events": [kill], "end_s": 40.0, "window_s": 2.0, "restarts": [(10.5, "tritonserver exited")],
           "ready_again": [12.5], "created": len(shots), "unfinished": 0}
    samples = [{"t": 1.0, "server_rss_mb": 200.0, "client_rss_mb": 80.0, "loadavg1": 1.5, "server_pid": 7}]
    [row] = sa.summarize(res, shots, samples)["events"]
    assert row["first_ok_s"] == pytest.approx(3.4)  # the first request sent at 13 s, done at 13.4 s
    assert (row["detected_s"], row["reason"], row["ready_again_s"]) == (0.5, "tritonserver exited", 2.5)
    assert row["p99_normal_s"] == pytest.approx(8.0) and row["errors_after"] == 150 and row["recovered"]
    res["restarts"], res["ready_again"] = [], []
    [row] = sa.summarize(res, steady(0, 40, 0.01, outcome="Overloaded"), samples)["events"]
    assert row["first_ok_s"] is None and row["detected_s"] is None and not row["recovered"]


def test_a_thin_window_is_not_normal() -> None:
    sparse = steady(0, 20, 0.01, rate=1.0)  # two requests per 2 s window, fewer than min_n
    assert faults.p99_back_after(sparse, 0.0, 1.0, 2.0, until=20.0) is None
    assert faults.p99_back_after(sparse, 0.0, 1.0, 2.0, until=20.0, min_n=2) == 0.0


def test_per_minute_rows_and_tally() -> None:
    shots = steady(0, 60, 0.02, rate=10) + steady(60, 90, 0.2, rate=10)
    shots[5] = sa.Shot(shots[5].sched, shots[5].done, "lost")
    shots[6] = sa.Shot(shots[6].sched, shots[6].done, "Overloaded")
    samples = [{"t": 1.0, "server_rss_mb": 200.0, "client_rss_mb": 80.0, "loadavg1": 1.5, "server_pid": 7},
               {"t": 70.0, "server_rss_mb": 210.0, "client_rss_mb": 81.0, "loadavg1": 2.5, "server_pid": 7}]
    res = {"events": [], "end_s": 90.0, "window_s": 2.0, "restarts": [], "ready_again": [], "created": 902,
           "unfinished": 2}
    rows = sa.summarize(res, shots, samples)["buckets"]
    assert [(r["sent"], r["ok"], r["errors"], r["lost"]) for r in rows] == [(600, 598, 1, 1), (300, 300, 0, 0)]
    assert rows[0]["p99_ms"] == pytest.approx(20.0) and rows[1]["p99_ms"] == pytest.approx(200.0)
    assert (rows[0]["server_rss_mb"], rows[1]["loadavg1"]) == (200.0, 2.5)
    assert sa.summarize(res, shots, samples)["tally"] == {
        "sent": 902, "ok": 898, "failed": 1, "lost": 3, "errors_by_kind": {"Overloaded": 1}}  # 2 never recorded


def test_rss_drift_whole_run_and_per_server() -> None:
    samples = [{"t": 0.0, "server_rss_mb": 300.0, "server_pid": 1}, {"t": 60.0, "server_rss_mb": 330.0,
                                                                     "server_pid": 1},
               {"t": 120.0, "server_rss_mb": 250.0, "server_pid": 2}, {"t": 180.0, "server_rss_mb": 270.0,
                                                                       "server_pid": 2},
               {"t": 240.0, "server_rss_mb": 271.0, "server_pid": 2}, {"t": 300.0, "server_rss_mb": 272.0,
                                                                       "server_pid": 2},
               {"t": 305.0, "server_rss_mb": math.nan, "server_pid": 0}]  # a sample taken while it restarted
    d = sa.rss_drift(samples, "server_rss_mb")
    assert (d["start_mb"], d["end_mb"]) == (300.0, 272.0) and d["per_min_mb"] == pytest.approx(-28.0 / 5.0)
    first, second = sa.rss_segments(samples, [], [], warmup_s=60.0)
    assert (first["pid"], first["start_mb"], first["end_mb"]) == (1, 300.0, 330.0)
    assert first["per_min_mb"] == pytest.approx(30.0)  # too short to leave out a warm-up: from its first sample
    assert (second["pid"], second["drift_from_s"]) == (2, 180.0)  # its first minute is warm-up
    assert second["per_min_mb"] == pytest.approx(1.0)
    assert math.isnan(sa.rss_drift(samples[:1], "server_rss_mb")["per_min_mb"])


def test_shot_log_keeps_outcomes_in_flat_arrays() -> None:
    log = sa.ShotLog()
    for k, outcome in enumerate(["ok", "Overloaded", "ok", "lost"]):
        log.append(float(k), k + 0.5, outcome)
    assert len(log.code) == 4 and list(log.kinds) == ["ok", "Overloaded", "lost"]
    assert [s.outcome for s in log.view()] == ["ok", "Overloaded", "ok", "lost"]
    assert log.view(1, since=2.0) == [sa.Shot(2.0, 2.5, "ok"), sa.Shot(3.0, 3.5, "lost")]


def test_windows_from_t() -> None:
    shots = steady(0, 12, 0.01, rate=1.0)
    # scheduled from 2 s on, three per 3 s window, n windows: 11.0 is left out
    assert [n for _, n in faults.window_p99s(shots, 2.0, 3.0, 3)] == [3, 3, 3]


def test_server_segments_leave_out_restarts() -> None:
    samples = [{"t": float(t), "server_rss_mb": 100.0 + t, "server_pid": 1 if t < 20 else 2} for t in range(0, 60, 5)]
    segments = sa.rss_segments(samples, restarts=[12.0, 41.0], ready_again=[33.0])  # the second never came back
    assert [(g["pid"], g["from_s"], g["to_s"]) for g in segments] == [(1, 0.0, 10.0), (2, 35.0, 40.0)]

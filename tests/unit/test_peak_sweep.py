"""The peak as saturation (issue 14): the sweep's parsing, windows and server-side probe, the per-path max rule,
the queue-policy check, the bench scenario that reaches loadtest.shipped, and the report's sweep table."""
from __future__ import annotations

import argparse
import math
import re
import socketserver
import threading
import time

import pytest

from bge_triton.errors import InputError
from bge_triton.loadtest import bench, core, loadgen, probe, report, sweep, targets
from bge_triton.loadtest.shipped import Candidate, ShippedRun, parse_args


def _peak(c: int, rate: float, **extra) -> dict:
    return {"throughput": rate, "load": f"C={c}", "concurrency": c, **extra}


def test_parse_concurrency_sorts_and_rejects_bad_lists():
    assert sweep.parse_concurrency("1024, 128,512") == (128, 512, 1024)
    assert sweep.parse_concurrency("64") == (64,)
    for bad, why in (("128,x", "not a whole number"), ("0,128", "must be >= 1"), ("128,128", "listed twice"),
                     ("", "not a whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            sweep.parse_concurrency(bad)


def test_shipped_flags_default_to_the_sweep_and_fail_on_a_bad_one(capsys: pytest.CaptureFixture):
    s, cands, target, concurrencies = parse_args(["--quick"])
    assert concurrencies == (128, 512, 1024) and s.concurrency == 1024 and target is None
    assert cands == (Candidate(),)
    assert parse_args(["--peak-concurrency", "256,64"])[3] == (64, 256)
    with pytest.raises(SystemExit):
        parse_args(["--peak-concurrency", "128,abc"])
    assert "'abc' is not a whole number" in capsys.readouterr().err


def test_saturation_is_the_highest_row_and_nan_counts_as_nothing():
    rows = [_peak(128, 704.0), _peak(512, 1060.0), _peak(1024, 1000.0), _peak(2048, math.nan)]
    assert targets.saturation(rows)["concurrency"] == 512
    assert targets.saturation([_peak(128, math.nan), _peak(512, 5.0)])["concurrency"] == 512
    with pytest.raises(ValueError, match="--peak-concurrency"):
        targets.saturation([])


def test_peak_verdicts_take_each_paths_highest_texts_per_s_over_the_sweep():
    low, direct = {"p50_ms": 10.0, "p99_ms": 19.0}, {"p50_ms": 9.0, "p99_ms": 18.0}
    text = [_peak(128, 704.0), _peak(512, 1060.0), _peak(1024, 1000.0)]
    tensor = [_peak(128, 170.0), _peak(512, 165.0), _peak(1024, 120.0)]
    vs = {v["target"]: v for v in targets.verdicts(low, text, direct, tensor, t1_ms=6.7, ideal=1241.0)}
    vs_ideal, vs_tensor = vs["peak texts/s / ideal at max batch"], vs["peak texts/s / tensor path texts/s"]
    assert vs_ideal["measured"] == pytest.approx(1060.0 / 1241.0) and vs_ideal["pass"]  # C=128 alone: 0.57, FAIL
    assert vs_ideal["at"] == "text C=512"
    assert vs_tensor["measured"] == pytest.approx(1060.0 / 170.0) and vs_tensor["at"] == "text C=512, tensor C=128"
    only_128 = targets.verdicts(low, text[:1], direct, tensor[:1], t1_ms=6.7, ideal=1241.0)
    assert not only_128[-1]["pass"]
    # per path, not at one shared C: at C=1024 text = tensor, but the tensor path's own best (C=128) is higher
    text, tensor = [_peak(128, 900.0), _peak(1024, 1000.0)], [_peak(128, 1150.0), _peak(1024, 1000.0)]
    vs_tensor = targets.verdicts(low, text, direct, tensor, t1_ms=6.7, ideal=1241.0)[3]
    assert vs_tensor["measured"] == pytest.approx(1000.0 / 1150.0) and not vs_tensor["pass"]


def test_windows_ramp_the_users_in_then_cover_rounds_of_their_requests_within_a_cap():
    ramp = 128 / sweep.CONNECTS_PER_S
    assert sweep.windows(128, 700.0, 0.5, 3.0) == (ramp, ramp + 0.5, 3.0)  # a round (0.18 s) fits the base windows
    ramp, warm, dur = sweep.windows(1024, 700.0, 0.5, 3.0)
    assert ramp == pytest.approx(1024 / sweep.CONNECTS_PER_S)
    assert warm == pytest.approx(ramp + 1.5 * 1024 / 700) and dur == pytest.approx(3 * 1024 / 700)
    assert sweep.windows(1024, 100.0, 0.5, 3.0)[1:] == (ramp + 9.0, 9.0)  # 10 s rounds: capped at 3 x the base
    assert sweep.windows(1024, 0.0, 0.5, 3.0)[1:] == (ramp + 0.5, 3.0)


def _stats(t: float) -> dict[str, float]:
    """Counters of a server completing 100 requests/s with 64 requests inside it at any time (64 s per s): 48 that
    succeed and 16 that time out."""
    return {"success_count": 100.0 * t, "success_ns": 48e9 * t, "fail_count": 0.0, "fail_ns": 16e9 * t}


def test_window_rates_from_timed_snapshots():
    samples = [(t / 4, _stats(t / 4)) for t in range(0, 41)]  # 0 .. 10 s every 0.25 s
    samples[-1] = (10.0, {"success_count": 1e9, "success_ns": 0.0, "fail_count": 7.0, "fail_ns": 0.0})  # outside
    got = sweep.window_rates(samples, 2.0, 6.0)
    assert got["server_rate"] == pytest.approx(100.0) and got["server_in_flight"] == pytest.approx(64.0)
    assert got["server_failures"] == 0.0
    assert all(math.isnan(v) for v in sweep.window_rates(samples, 2.1, 2.2).values())  # under two samples


def test_peak_sweep_runs_ascending_with_windows_from_the_previous_point(monkeypatch: pytest.MonkeyPatch):
    class FakeSampler:
        def __init__(self, url: str, model: str):
            self.samples = [(t / 4, _stats(t / 4)) for t in range(0, 200)]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    calls = []

    def measure(users: int, warmup_s: float, duration_s: float, ramp_s: float) -> dict:
        calls.append((users, ramp_s, warmup_s, duration_s))
        return {"throughput": {128: 700.0, 1024: 900.0}[users], "window_start": 1.0}

    monkeypatch.setattr(sweep, "StatsSampler", FakeSampler)
    rows = sweep.peak_sweep(measure, "127.0.0.1:1", "m", (128, 1024), 150.0, 0.5, 3.0)
    assert [r["concurrency"] for r in rows] == [128, 1024]
    assert calls[0][1:] == sweep.windows(128, 150.0, 0.5, 3.0)  # the first point: the batch-1 guess
    assert calls[1][1:] == sweep.windows(1024, 700.0, 0.5, 3.0)  # then the rate measured at C=128
    assert rows[1]["server_in_flight"] == pytest.approx(64.0) and rows[1]["window_s"] == calls[1][3]


def test_queue_check_names_what_would_reject_c_users():
    assert targets.queue_check(1024, 2048, 5_000_000, 800.0) == ""  # the text endpoint at C=1024
    tensor = targets.queue_check(1024, 1024, 2_000_000, 170.0)  # the encoder's queue, tensor mode's rate
    assert "Request timeout expired" in tensor and "6.0 s > timeout 2 s" in tensor and "Exceeds" not in tensor
    assert "Exceeds maximum queue size" in targets.queue_check(2000, 1024, 0, 1e6)
    both = targets.queue_check(5000, 2048, 5_000_000, 900.0)
    assert both.startswith("C=5000 > max_queue_size 2048") and both.endswith("5.6 s > timeout 5 s: 'Request timeout "
                                                                             "expired'")
    assert targets.queue_check(5000, 0, 0, 1.0) == ""  # 0 = no limit, no timeout
    assert "timeout" in targets.queue_check(10, 0, 1_000_000, 0.0)  # nothing served: every request expires


def test_the_seed_bench_hands_nothing_over_to_the_shipped_scenario():
    with pytest.raises(SystemExit, match="bge-triton bench shipped"):  # its own scenario, named, never a hand-over
        bench.main(["--scenarios", "shipped", "--quick"])


def test_ensure_open_files_raises_the_soft_limit_or_names_the_fix(monkeypatch: pytest.MonkeyPatch):
    import resource

    set_to = []
    monkeypatch.setattr(resource, "setrlimit", lambda what, lim: set_to.append(lim))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 4096))
    loadgen.ensure_open_files(1024)
    assert set_to == [(1280, 4096)]
    loadgen.ensure_open_files(512)  # 768 fits the soft limit: nothing to change
    assert len(set_to) == 1
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 1100))
    with pytest.raises(InputError, match="hard limit is 1100"):
        loadgen.ensure_open_files(1024)


def _row(cand: str, path: str, phase: str, c: int | None, rate: float, errors: int = 0) -> dict:
    return {"candidate": cand, "path": path, "phase": phase, "load": f"C={c}" if c else "30/s", "concurrency": c,
            "throughput": rate, "p50_ms": 10.0, "p99_ms": 20.0, "avg_batch": 8.0, "front_batch": 40.0, "queue_ms": 1.0,
            "compute_ms": 9.0, "errors": errors, "unanswered": 0,
            "first_error": "HTTP 503: Request timeout expired" if errors else "",
            "server_cores": 0.5, "text_cores": 0.1, "gen_cores": 0.2, "server_rate": rate, "server_in_flight": c or 1.0,
            "loop_lag_ms": 2.0, "loop_lag_max_ms": 9.0, "max_queue_size": 1024, "queue_timeout_us": 2_000_000,
            "text_instances": 2}


def test_report_shows_every_c_and_judges_the_saturation_point(tmp_path):
    from bge_triton.loadtest.shipped import ideal, write_report

    s = core.BenchSettings(out=tmp_path, duration_s=3.0, low_duration_s=6.0, warmup_s=0.5)
    run = ShippedRun("bge-triton bench shipped --quick", (Candidate(),), (128, 512, 1024),
                     lengths={"median": 48, "mean": 71.0, "max": 258, "all": [20, 48, 48, 71, 120, 258]},
                     machine=report.machine_info(), selfcheck_rps=5000.0, picked="committed")
    run.rows = [{**_row("committed", "direct_delay0", "low", None, 29.0), "turns": 8, "turn_s": 2.0},
                _row("committed", "text", "low", None, 29.0), _row("committed", "text", "peak", 128, 704.0),
                _row("committed", "text", "peak", 512, 1000.0), _row("committed", "text", "peak", 1024, 960.0),
                _row("committed", "tensor_buckets", "low", None, 29.0),
                _row("committed", "tensor_buckets", "peak", 128, 170.0),
                _row("committed", "tensor_buckets", "peak", 512, 165.0),
                _row("committed", "tensor_buckets", "peak", 1024, 160.0, errors=300)]
    peaks = lambda p: [r for r in run.rows if r["path"] == p and r["phase"] == "peak"]  # noqa: E731
    run.verdicts["committed"] = targets.verdicts(run.rows[1], peaks("text"), run.rows[0], peaks("tensor_buckets"),
                                                 6.7, ideal(s, run))
    md = write_report(run, s)[0].read_text(encoding="utf-8")
    assert "take turns in one window, 8 turns of 2 s each (ABBA" in md
    sweep_rows = [line for line in md.splitlines() if re.match(r"\| committed \| (128|512|1024) \| ", line)]
    assert len(sweep_rows) == 3
    assert sweep_rows[0].split(" | ")[2:6] == ["704", "**170**", "4.14", f"{704 / ideal(s, run):.2f}"]
    assert sweep_rows[1].split(" | ")[2] == "**1000**"  # the text path's saturation point
    assert f"| peak texts/s / ideal at max batch | >= 0.85 | {1000 / ideal(s, run):.2f} | text C=512 |" in md
    assert ("| committed | tensor_buckets | 1024 | 160 | 160 | 1024 | 2.00 / 9.0 | 1024 | 0.20 | 1024 / 2 | "
            "wait ~C / rate = 6.4 s") in md  # 1024 - 160/s x 2 ms = 1024 held
    assert "| committed | text | 1024 | 960 | 960 | 1024 | 2.00 / 9.0 | 1022 |" in md
    assert "| 300 | 0 | HTTP 503: Request timeout expired |" in md  # errors, unanswered, first error
    assert "- committed, tensor_buckets: the queue policy rejects at C=512, 1024; errors at C=1024." in md
    assert "- committed, text: the queue policy holds every C of the sweep; no errors." in md
    est = [line.split(" | ")[9:11] for line in sweep_rows]  # the scheduler's closed-loop estimate, text / it
    assert all(float(e) > 0 and float(ratio) > 0 for e, ratio in est)
    assert "| committed | text | 1024 | 960 |" in md and "Request timeout expired" in md
    assert "| 1024 | 628 |" in md and "| 512 | 64 |" in md  # the pool table reaches 1024 texts


class _FakeTriton(socketserver.ThreadingTCPServer):
    """A local HTTP/1.1 endpoint that answers every request with 200, or (silent=True) reads and never answers."""

    daemon_threads = allow_reuse_address = True

    def __init__(self, silent: bool):
        self.silent, self.connect_times, self.release = silent, [], threading.Event()
        super().__init__(("127.0.0.1", 0), _FakeHandler)


class _FakeHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.server.connect_times.append(time.time())  # loadgen's t0 is on this (wall clock) scale
        while True:
            length = 0
            while (line := self.rfile.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line:
                return
            self.rfile.read(length)
            if self.server.silent:  # holds the request until the test is over
                self.server.release.wait(60)
                return
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")


@pytest.fixture
def fake_triton(request):
    server = _FakeTriton(silent=request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def _spec(server, **kw) -> loadgen.LoadSpec:
    return loadgen.LoadSpec("127.0.0.1", server.server_address[1], "m", (loadgen.text_request("好"),), "closed", **kw)


@pytest.mark.parametrize("fake_triton", [False], indirect=True)
def test_closed_loop_ramps_its_users_in(fake_triton):
    """User k may not connect before t0 + k/5 x 0.5 s: so the j-th connection (from 0) comes at t0 + j x 0.1 s or
    later, whatever delays a busy machine adds (they only make it later); without the ramp all come at t0."""
    res = loadgen.run(_spec(fake_triton, concurrency=5, warmup_s=0.6, duration_s=1.0, ramp_s=0.5))
    assert res.ok > 0 and res.errors == 0 and res.late == 0
    assert 0.0 < res.loop_lag_max_ms and res.loop_lag_ms <= res.loop_lag_max_ms  # the lag probe ran in the window
    t0 = res.window_start - 0.6
    first = sorted(fake_triton.connect_times)
    assert len(first) == 5  # one keep-alive connection per user
    assert all(at >= t0 + j * 0.1 - 0.005 for j, at in enumerate(first)), [round(at - t0, 3) for at in first]


@pytest.mark.parametrize("fake_triton", [True], indirect=True)
def test_closed_loop_counts_unanswered_requests_instead_of_hanging(fake_triton):
    """The server holds every request until the test is over: the run still ends (after the grace), counting them."""
    out: list[loadgen.LoadResult] = []
    runner = threading.Thread(target=lambda: out.append(loadgen.run(_spec(
        fake_triton, concurrency=4, warmup_s=0.1, duration_s=1.0, grace_s=0.3))), daemon=True)
    runner.start()
    runner.join(60)  # a bound on a hang only: the run ends by itself after its window and grace
    assert out, "the load run did not end while the server held its requests"
    res = out[0]
    assert res.late == 4 and res.ok == 0 and "4 requests unanswered" in res.first_error


def test_probe_command_parses_its_flags(capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as exit_info:
        probe.main(["--help"])
    assert exit_info.value.code == 0 and "--ramp-s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        probe.main(["--concurrency", "0"])
    assert "must be >= 1" in capsys.readouterr().err

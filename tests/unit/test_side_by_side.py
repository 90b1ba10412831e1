"""core.measure_side_by_side: the quiet-hour paths take turns in one window (ABBA), each row holds only its own
requests and its own models' Triton counters, summed over its turns (fake load generator, stats and CPU meter)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from bge_triton.loadtest import core, loadgen


class _Meter:
    def __init__(self, pid=None) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self):
        return 10.0, 0.5, 0.1  # machine %, server cores, generator cores


def test_legs_take_turns_abba_and_each_row_counts_its_own_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    executions = {"txt": 0, "enc": 0, "ref": 0}

    def run(spec: loadgen.LoadSpec) -> loadgen.LoadResult:
        calls.append(spec.model)
        assert spec.mode == "open" and spec.rate == 30.0 and spec.duration_s == 2.0 and spec.warmup_s == 0.25
        slow = spec.model == "txt"  # the text path answers in 11 ms, the reference in 9 ms
        for m in (("txt", "enc") if slow else ("ref",)):
            executions[m] += 60  # one execution per request, 60 per turn
        return loadgen.LoadResult(window_s=2.0, ok=60, latencies_ms=[11.0 if slow else 9.0] * 60,
                                  errors=1 if slow else 0, first_error="HTTP 503" if slow else "")

    def stats(url: str, model: str) -> dict[str, float]:
        n = float(executions[model])  # cumulative counters, as Triton's are
        return {"success_count": n, "execution_count": n, "inference_count": n, "queue_ns": n * 2e5,
                "compute_input_ns": 0.0, "compute_infer_ns": n * (8e6 if model != "txt" else 1e7),
                "compute_output_ns": 0.0}

    monkeypatch.setattr(loadgen, "run", run)
    monkeypatch.setattr(core, "fetch_stats", stats)
    monkeypatch.setattr(core, "CpuMeter", _Meter)
    h = SimpleNamespace(host_port=("127.0.0.1", 1), live=SimpleNamespace(http_url="127.0.0.1:1", pid=1))
    s = core.BenchSettings(low_duration_s=8.0, warmup_s=2.0)
    cpu = iter(range(100))
    text, ref = core.measure_side_by_side(h, s, [core.Leg("txt", ("txt", "enc"), (b"t",)),
                                                  core.Leg("ref", ("ref",), (b"r",))], 30.0, block_s=2.0,
                                           probe=lambda: {7: float(next(cpu))})
    assert calls == ["txt", "ref", "ref", "txt", "txt", "ref", "ref", "txt"]  # ABBA: the drift falls on both
    assert (text["n"], ref["n"]) == (240, 240) and (text["p50_ms"], ref["p50_ms"]) == (11.0, 9.0)
    assert (text["errors"], ref["errors"]) == (4, 0) and text["first_error"] == "HTTP 503"
    assert text["throughput"] == ref["throughput"] == 240 / 8.0 and text["window_s"] == 8.0 and text["turns"] == 4
    # Triton's counters: each leg's own models over its own turns only (the other leg's requests are not in them)
    assert text["queue_ms"] == pytest.approx(0.2) and text["compute_ms"] == pytest.approx(8.0)  # txt queue, enc compute
    assert ref["compute_ms"] == pytest.approx(8.0) and ref["avg_batch"] == pytest.approx(1.0)
    assert text["server_cores"] == pytest.approx(0.5) and text["phase"] == "low" and text["load"] == "30/s"
    assert text["probe_cores"] > 0 and ref["probe_cores"] > 0  # one CPU-second per turn, over the leg's wall time

"""Measurement arithmetic of every benchmark: THE percentile, deltas of Triton's /v2/models/<m>/stats, CPU use.

Stdlib + numpy at import (the bare GPU host imports it); psutil is imported by the functions that need it.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from bge_triton.errors import ServerUnavailable

_PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
_COUNTERS = ("inference_count", "execution_count", *(f"{p}_{u}" for p in _PHASES for u in ("count", "ns")))


def percentile(values, q: float) -> float:
    """q-th percentile (0..100), numpy's default linear interpolation; nan when empty. The kit's only one."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def histogram_percentile(hist: Mapping[Any, int], q: float) -> float:
    """percentile() of the multiset a {value: count} histogram stands for (Locust's response_times)."""
    pairs = [(v, n) for v, n in hist.items() if n > 0]
    return percentile(np.repeat([float(v) for v, _ in pairs], [n for _, n in pairs]), q)


def histogram_delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """Window histogram from two cumulative {rounded ms: count} histograms (Locust's response_times)."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0) > 0}


@dataclass(frozen=True)
class LatencySummary:
    """Client-side latency of the requests that completed in a window (milliseconds)."""

    count: int
    avg_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def summarize(latencies_ms: list[float]) -> LatencySummary:
    """avg / p50 / p90 / p99 / max of a list of latencies."""
    if not latencies_ms:
        return LatencySummary(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    return LatencySummary(len(latencies_ms), sum(latencies_ms) / len(latencies_ms), percentile(latencies_ms, 50),
                          percentile(latencies_ms, 90), percentile(latencies_ms, 99), max(latencies_ms))


def flatten_stats(payload: dict) -> dict[str, float]:
    """Sum one model's stats JSON over its versions into flat counters (count/ns per phase)."""
    flat = dict.fromkeys(_COUNTERS, 0.0)
    for entry in payload.get("model_stats", []):
        for key in flat:
            phase, unit = key.rsplit("_", 1)
            inf = entry.get("inference_stats", {}).get(phase, {})
            flat[key] += float(entry.get(key, 0) if phase in ("inference", "execution") else inf.get(unit, 0))
    return flat


@dataclass(frozen=True)
class StatsDelta:
    """What Triton did between two snapshots: requests, batches and where the time went."""

    requests: int
    failures: int
    executions: int
    avg_batch: float
    queue_ms: float  # average per successful request
    compute_ms: float  # input + infer + output, average per successful request (its batch's time)


def stats_delta(before: dict[str, float], after: dict[str, float]) -> StatsDelta:
    """Difference of two flattened snapshots (flatten_stats); zero-safe."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ok, execs = d.get("success_count", 0.0), d.get("execution_count", 0.0)
    compute = sum(d.get(f"{p}_ns", 0.0) for p in ("compute_input", "compute_infer", "compute_output"))
    return StatsDelta(
        requests=int(ok), failures=int(d.get("fail_count", 0.0)), executions=int(execs),
        avg_batch=d.get("inference_count", 0.0) / execs if execs else math.nan,
        queue_ms=d.get("queue_ns", 0.0) / ok / 1e6 if ok else math.nan,
        compute_ms=compute / ok / 1e6 if ok else math.nan)


def phase_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms per request of each phase Triton counts (success = arrival to response) between two snapshots."""
    return {p: (after[f"{p}_ns"] - before[f"{p}_ns"]) / 1e6 / max(1.0, after[f"{p}_count"] - before[f"{p}_count"])
            for p in _PHASES if p != "fail"}


def fetch_stats(http_url: str, model: str, timeout_s: float = 5.0) -> dict[str, float]:
    """GET /v2/models/<model>/stats from host:port (or http://host:port) and flatten it."""
    url = f"{http_url if http_url.startswith('http') else 'http://' + http_url}/v2/models/{model}/stats"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return flatten_stats(json.loads(resp.read()))
    except OSError as exc:
        raise ServerUnavailable(f"cannot read {url}: {exc}; is the server up and the model loaded?") from exc


def process_tree(pid: int) -> list[Any]:
    """The server process and its children (the python backend stubs), as psutil processes; [] once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _read(pid: int | None, read: Callable[[Any], Any]) -> dict[int, Any]:
    """pid -> read(process) over the process tree of `pid`, of each process still there when it is read."""
    import psutil

    out = {}
    for proc in process_tree(pid) if pid else []:
        with contextlib.suppress(psutil.NoSuchProcess):
            out[proc.pid] = read(proc)
    return out


def tree_rss_mb(pid: int) -> float:
    """Resident memory of tritonserver + its stub children, in MiB."""
    return sum(_read(pid, lambda p: p.memory_info().rss).values()) / 2**20


def stub_pids(pid: int) -> dict[int, str]:
    """pid -> command line of the python backend stubs under a tritonserver pid."""
    return {p: c for p, c in _read(pid, lambda p: " ".join(p.cmdline())).items() if "triton_python_backend_stub" in c}


class CpuMeter:
    """CPU use over a window: the machine (%), the server's process tree and this generator (cores busy). Per-pid
    deltas: a stub that starts mid-window counts from zero; one that exits loses its time."""

    def __init__(self, pid: int | None = None):
        import psutil

        self._ps, self.pid, self._t0, self._start = psutil, pid, 0.0, dict[int, float]()

    def _both(self) -> dict[int, float]:
        """Server tree under +pid, the generator (this process and its children minus the server) under -pid."""
        server = _read(self.pid, lambda p: sum(p.cpu_times()[:2]))
        mine = _read(os.getpid(), lambda p: sum(p.cpu_times()[:2]))
        return {**server, **{-pid: v for pid, v in mine.items() if pid not in server}}

    def start(self) -> None:
        self._ps.cpu_percent(None)
        self._t0, self._start = time.monotonic(), self._both()

    def stop(self) -> tuple[float, float, float]:
        """(machine CPU %, server process-tree cores, load-generator cores) since start()."""
        wall = max(time.monotonic() - self._t0, 1e-9)
        now = self._both()
        server = sum(v - self._start.get(pid, 0.0) for pid, v in now.items() if pid > 0)
        gen = sum(v - self._start.get(pid, 0.0) for pid, v in now.items() if pid < 0)
        return self._ps.cpu_percent(None), server / wall, gen / wall

"""Pure arithmetic of the soak (no server, no clock): durations, the event plan, per-minute rows, recovery times
and RSS drift, over plain records so the unit tests can feed it made-up runs.

Latency counts from the SCHEDULED send time (open loop); a failed or lost request counts as an infinite latency
in a recovery window, so a window of errors is never "normal".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from bge_triton.errors import InputError
from bge_triton.loadtest.stats import percentile

EVENT_KINDS = ("kill9_server", "kill9_stub", "overload_spike")
_FAILED = 1e9  # the latency a failed request stands for (seconds): beyond any threshold
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'20m', '40s', '1h', '90' (seconds) or '1m30s' -> seconds; InputError naming the format otherwise."""
    parts = re.fullmatch(r"\s*((?:\d+(?:\.\d+)?[smh]?\s*)+)\s*", text or "")
    if not parts:
        raise InputError(f"--soak {text!r}: use a duration such as 20m, 40s, 1h or 1m30s")
    total = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh]?)", parts.group(1)))
    if total < 20:
        raise InputError(f"--soak {text!r} is {total:.0f} s: a soak needs at least 20 s (three faults and "
                         "their recoveries)")
    return total


@dataclass(frozen=True)
class Shot:
    """One request: scheduled at `sched` s after the soak began, finished at `done` s; outcome 'ok', an error
    kind, or 'lost' (neither a result nor an error within the deadline)."""

    sched: float
    done: float
    outcome: str

    @property
    def latency(self) -> float:
        return self.done - self.sched


@dataclass(frozen=True)
class PlannedEvent:
    """A fault to inject at `at` s (or later: never before the previous one recovered); spikes last `length`."""

    kind: str
    at: float
    length: float = 0.0


def plan_events(duration_s: float, spike_factor_s: float = 30.0) -> list[PlannedEvent]:
    """kill -9 of the server at 25%, of the encoder's stub at 50%, an overload spike at 75% of the soak.

    The spike lasts 30 s, or 8% of a soak shorter than 6 min 15 s (the compressed plan of a short soak).
    """
    spike = min(spike_factor_s, 0.08 * duration_s)
    return [PlannedEvent("kill9_server", 0.25 * duration_s), PlannedEvent("kill9_stub", 0.50 * duration_s),
            PlannedEvent("overload_spike", 0.75 * duration_s, spike)]


def window_width(duration_s: float) -> float:
    """Recovery-window width: 10 s for a 20 min soak, down to 2 s for a short one."""
    return max(2.0, min(10.0, duration_s / 120.0))


def window_p99(shots: list[Shot], start: float, width: float) -> tuple[float, int]:
    """p99 latency (s) of the requests scheduled in [start, start + width), failures and losses counted as
    infinitely slow (inf whenever they reach into the top 1%)."""
    lat = [s.latency if s.outcome == "ok" else _FAILED for s in shots if start <= s.sched < start + width]
    if not lat:
        return math.nan, 0
    p99 = percentile(lat, 99)
    return (math.inf if p99 >= _FAILED / 1e3 else p99), len(lat)


def baseline_p99(shots: list[Shot], start: float, end: float) -> float:
    """p99 of the successful requests scheduled in [start, end) (the calm stretch before the first fault)."""
    return percentile([s.latency for s in shots if s.outcome == "ok" and start <= s.sched < end], 99)


def normal_threshold(base_p99: float, factor: float = 2.0, floor_s: float = 0.05) -> float:
    """What counts as p99 'back to normal': within `factor` x the calm p99, never tighter than floor_s."""
    return max(factor * base_p99, floor_s) if not math.isnan(base_p99) else math.inf


def first_ok_after(shots: list[Shot], t: float) -> float | None:
    """Seconds from t to the first success of a request sent at or after t (None: no such success)."""
    done = [s.done for s in shots if s.outcome == "ok" and s.sched >= t]
    return min(done) - t if done else None


def p99_back_after(shots: list[Shot], t: float, threshold_s: float, width: float, until: float,
                   hold: int = 3, min_n: int = 5) -> float | None:
    """Seconds from t to the start of the first window whose p99 <= threshold and stays so `hold` windows running.

    Windows are consecutive, `width` s wide, starting at t, t + width, ... and ending by `until`; one with fewer
    than min_n requests does not count as normal. None when that never happens.
    """
    bins: dict[int, list[Shot]] = {}
    for s in shots:  # one pass: a soak holds hundreds of thousands of shots
        if t <= s.sched < until:
            bins.setdefault(int((s.sched - t) // width), []).append(s)
    normal = []
    for k in range(max(0, int((until - t) / width + 1e-9))):
        p99, n = window_p99(bins.get(k, []), t + k * width, width)
        normal.append(n >= min_n and p99 <= threshold_s)
    for k in range(len(normal) - hold + 1):
        if all(normal[k:k + hold]):
            return k * width
    return None


def bucket_rows(shots: list[Shot], samples: list[dict], bucket_s: float, end: float) -> list[dict]:
    """Per bucket (a minute by default) of scheduled time: sent / ok / errors / lost, p50 and p99 of the
    successes (ms), and the last resource sample in it (server and client RSS, load average)."""
    rows = []
    for k in range(max(1, math.ceil(end / bucket_s - 1e-9))):
        lo, hi = k * bucket_s, (k + 1) * bucket_s
        mine = [s for s in shots if lo <= s.sched < hi]
        ok = [s.latency * 1e3 for s in mine if s.outcome == "ok"]
        inside = [x for x in samples if lo <= x["t"] < hi]
        last = inside[-1] if inside else {}
        rows.append({"bucket": k, "start_s": lo, "sent": len(mine), "ok": len(ok),
                     "errors": sum(1 for s in mine if s.outcome not in ("ok", "lost")),
                     "lost": sum(1 for s in mine if s.outcome == "lost"),
                     "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99),
                     "server_rss_mb": last.get("server_rss_mb", math.nan),
                     "client_rss_mb": last.get("client_rss_mb", math.nan),
                     "loadavg1": last.get("loadavg1", math.nan), "server_pid": last.get("server_pid", 0)})
    return rows


def rss_drift(samples: list[dict], key: str) -> dict:
    """Start vs end of one RSS series (MiB) and the drift per minute; also over the last stretch of one server
    pid (a restarted server starts from scratch, so the whole-run figure mixes processes)."""
    pts = [(x["t"], x[key], x.get("server_pid", 0)) for x in samples if not math.isnan(x.get(key, math.nan))]
    if len(pts) < 2:
        return {"start_mb": math.nan, "end_mb": math.nan, "per_min_mb": math.nan, "segment_per_min_mb": math.nan,
                "segment_minutes": 0.0}
    (t0, v0, _), (t1, v1, pid) = pts[0], pts[-1]
    k = len(pts) - 1
    while k > 0 and pts[k - 1][2] == pid:
        k -= 1
    seg = pts[k:]
    seg_min = (seg[-1][0] - seg[0][0]) / 60.0
    return {"start_mb": v0, "end_mb": v1, "per_min_mb": (v1 - v0) / max((t1 - t0) / 60.0, 1e-9),
            "segment_per_min_mb": (seg[-1][1] - seg[0][1]) / seg_min if seg_min > 0 else math.nan,
            "segment_minutes": seg_min}


def tally(shots: list[Shot]) -> dict:
    """sent / ok / failed with an error / lost, and the errors by kind."""
    kinds: dict[str, int] = {}
    for s in shots:
        if s.outcome not in ("ok", "lost"):
            kinds[s.outcome] = kinds.get(s.outcome, 0) + 1
    return {"sent": len(shots), "ok": sum(s.outcome == "ok" for s in shots), "failed": sum(kinds.values()),
            "lost": sum(s.outcome == "lost" for s in shots), "errors_by_kind": kinds}

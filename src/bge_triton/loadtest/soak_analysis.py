"""Pure arithmetic of the soak (no server, no clock): durations, the event plan, per-minute rows, recovery times
and RSS drift, over plain records so the unit tests can feed it made-up runs.

Latency counts from the SCHEDULED send time (open loop); a failed or lost request counts as an infinite latency
in a recovery window, so a window of errors is never "normal".
"""
from __future__ import annotations

import math
import re
from array import array
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
        raise InputError(f"--duration {text!r}: use a duration such as 20m, 40s, 1h or 1m30s")
    total = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh]?)", parts.group(1)))
    if total < 20:
        raise InputError(f"--duration {text!r} is {total:.0f} s: a soak needs at least 20 s (three faults and "
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


class ShotLog:
    """Every request's (sched, done, outcome) in flat arrays: 17 bytes a request, so the clients' process RSS
    measures the SDK rather than the harness's bookkeeping (a list of objects would grow by ~200 bytes a request)."""

    def __init__(self) -> None:
        self.sched, self.done, self.code = array("d"), array("d"), array("B")
        self.kinds: list[str] = ["ok"]

    def append(self, sched: float, done: float, outcome: str) -> None:
        if outcome not in self.kinds:
            self.kinds.append(outcome)
        self.sched.append(sched)
        self.done.append(done)
        self.code.append(self.kinds.index(outcome))

    def __len__(self) -> int:
        return len(self.code)

    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in (self.sched, self.done, self.code))

    def view(self, index: int = 0, since: float = -math.inf) -> list[Shot]:
        """Shots recorded from `index` on that were scheduled at or after `since`."""
        k = self.kinds
        return [Shot(a, b, k[c]) for a, b, c in zip(self.sched[index:], self.done[index:], self.code[index:],
                                                    strict=False)
                if a >= since]


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


def bin_shots(shots: list[Shot], t: float, width: float) -> dict[int, list[Shot]]:
    """Shots scheduled at or after t, by window index k = (sched - t) // width, in one pass (a soak holds
    hundreds of thousands of them)."""
    bins: dict[int, list[Shot]] = {}
    for s in shots:
        if s.sched >= t:
            bins.setdefault(int((s.sched - t) // width), []).append(s)
    return bins


def p99_back_after(shots: list[Shot], t: float, threshold_s: float, width: float, until: float,
                   hold: int = 3, min_n: int = 5) -> float | None:
    """Seconds from t to the start of the first window whose p99 <= threshold and stays so `hold` windows running.

    Windows are consecutive, `width` s wide, starting at t, t + width, ... and ending by `until`; one with fewer
    than min_n requests does not count as normal. None when that never happens.
    """
    bins = bin_shots([s for s in shots if s.sched < until], t, width)
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
    bins = bin_shots(shots, 0.0, bucket_s)
    for k in range(max(1, math.ceil(end / bucket_s - 1e-9))):
        lo, hi = k * bucket_s, (k + 1) * bucket_s
        mine = bins.get(k, [])
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


def serving_samples(samples: list[dict], restarts: list[float], ready_again: list[float]) -> list[dict]:
    """The samples taken while a server was serving: none from a restart's announcement to its ready-again
    (a server that is being stopped has unloaded its models: its RSS says nothing about drift)."""
    spans = [(r, min((t for t in ready_again if t >= r), default=math.inf)) for r in restarts]
    return [x for x in samples if not any(a <= x["t"] <= b for a, b in spans)]


def rss_segments(samples: list[dict], key: str = "server_rss_mb", warmup_s: float = 60.0) -> list[dict]:
    """One row per server process (pid) of an RSS series: its minutes, first and last MiB, and the drift per
    minute after its first `warmup_s` (a fresh server grows while its caches fill; only a long-lived one drifts)."""
    rows: list[dict] = []
    for x in samples:
        if math.isnan(x.get(key, math.nan)):
            continue
        if not rows or rows[-1]["pid"] != x.get("server_pid", 0):
            rows.append({"pid": x.get("server_pid", 0), "pts": []})
        rows[-1]["pts"].append((x["t"], x[key]))
    out = []
    for r in rows:
        pts = r["pts"]
        warm = [p for p in pts if p[0] >= pts[0][0] + warmup_s]
        base = warm[0] if len(warm) >= 2 else pts[0]
        minutes = (pts[-1][0] - base[0]) / 60.0
        out.append({"pid": r["pid"], "from_s": pts[0][0], "to_s": pts[-1][0], "start_mb": pts[0][1],
                    "end_mb": pts[-1][1], "drift_from_s": base[0],
                    "per_min_mb": (pts[-1][1] - base[1]) / minutes if minutes > 0 else math.nan})
    return out


def rss_drift(samples: list[dict], key: str) -> dict:
    """Start vs end of one RSS series (MiB) and the drift per minute over the whole run (across restarts)."""
    pts = [(x["t"], x[key]) for x in samples if not math.isnan(x.get(key, math.nan))]
    if len(pts) < 2:
        return {"start_mb": math.nan, "end_mb": math.nan, "per_min_mb": math.nan}
    (t0, v0), (t1, v1) = pts[0], pts[-1]
    return {"start_mb": v0, "end_mb": v1, "per_min_mb": (v1 - v0) / max((t1 - t0) / 60.0, 1e-9)}


def tally(shots: list[Shot]) -> dict:
    """sent / ok / failed with an error / lost, and the errors by kind."""
    kinds: dict[str, int] = {}
    for s in shots:
        if s.outcome not in ("ok", "lost"):
            kinds[s.outcome] = kinds.get(s.outcome, 0) + 1
    return {"sent": len(shots), "ok": sum(s.outcome == "ok" for s in shots), "failed": sum(kinds.values()),
            "lost": sum(s.outcome == "lost" for s in shots), "errors_by_kind": kinds}

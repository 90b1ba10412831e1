"""The soak's arithmetic over plain records (no server, no clock): durations, the fault plan, recovery times,
per-minute rows, RSS drift and the report's summary. Latency counts from the SCHEDULED send time; a failed or lost
request counts as infinitely slow in a recovery window, so a window of errors is never "normal"."""
from __future__ import annotations

import math
import re
from array import array
from dataclasses import dataclass
from typing import Any

from bge_triton.errors import InputError
from bge_triton.loadtest.stats import percentile

EVENT_KINDS = ("kill9_server", "kill9_stub", "overload_spike")
_FAILED = 1e9  # the latency (s) a failed request stands for: beyond any threshold
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'20m', '40s', '1h', '90' (seconds) or '1m30s' -> seconds, at least 20; InputError naming the format."""
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
    """One request: scheduled at `sched` s, finished at `done` s; 'ok', an error kind, or 'lost'."""

    sched: float
    done: float
    outcome: str

    @property
    def latency(self) -> float:
        return self.done - self.sched


class ShotLog:
    """Every request's (sched, done, outcome) in flat arrays, 17 bytes a request, so the client's RSS measures
    the SDK rather than this bookkeeping."""

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
        rows = zip(self.sched[index:], self.done[index:], self.code[index:], strict=True)
        return [Shot(a, b, self.kinds[c]) for a, b, c in rows if a >= since]


@dataclass(frozen=True)
class PlannedEvent:
    """A fault to inject at `at` s (never before the previous one recovered); a spike lasts `length` s."""

    kind: str
    at: float
    length: float = 0.0


def plan_events(duration_s: float, spike_s: float = 30.0) -> list[PlannedEvent]:
    """kill -9 of the server at 25%, of the encoder's stub at 50%, an overload spike at 75% of the soak, lasting
    spike_s or 8% of the soak, whichever is shorter."""
    return [PlannedEvent("kill9_server", 0.25 * duration_s), PlannedEvent("kill9_stub", 0.50 * duration_s),
            PlannedEvent("overload_spike", 0.75 * duration_s, min(spike_s, 0.08 * duration_s))]


def window_width(duration_s: float) -> float:
    """Recovery-window width: 10 s for a 20 min soak, down to 2 s for a short one."""
    return max(2.0, min(10.0, duration_s / 120.0))


def window_p99(shots: list[Shot], start: float, width: float) -> tuple[float, int]:
    """(p99 latency in s, count) of the requests scheduled in [start, start + width); failures count as infinite."""
    lat = [s.latency if s.outcome == "ok" else _FAILED for s in shots if start <= s.sched < start + width]
    if not lat:
        return math.nan, 0
    p99 = percentile(lat, 99)
    return (math.inf if p99 >= _FAILED / 1e3 else p99), len(lat)


def baseline_p99(shots: list[Shot], start: float, end: float) -> float:
    """p99 of the successes scheduled in [start, end) (the calm stretch before the first fault)."""
    return percentile([s.latency for s in shots if s.outcome == "ok" and start <= s.sched < end], 99)


def normal_threshold(base_p99: float, factor: float = 2.0, floor_s: float = 0.05) -> float:
    """p99 'back to normal': within `factor` x the calm p99, never tighter than floor_s."""
    return max(factor * base_p99, floor_s) if not math.isnan(base_p99) else math.inf


def first_ok_after(shots: list[Shot], t: float) -> float | None:
    """Seconds from t to the first success of a request sent at or after t (None: none)."""
    done = [s.done for s in shots if s.outcome == "ok" and s.sched >= t]
    return min(done) - t if done else None


def bin_shots(shots: list[Shot], t: float, width: float) -> dict[int, list[Shot]]:
    """Shots scheduled at or after t by window index (sched - t) // width, in one pass."""
    bins: dict[int, list[Shot]] = {}
    for s in shots:
        if s.sched >= t:
            bins.setdefault(int((s.sched - t) // width), []).append(s)
    return bins


def p99_back_after(shots: list[Shot], t: float, threshold_s: float, width: float, until: float,
                   hold: int = 3, min_n: int = 5) -> float | None:
    """Seconds from t to the start of the first `width` s window (of those from t, ending by `until`) whose p99 is
    within threshold_s for `hold` windows running; a window of fewer than min_n requests is not normal."""
    bins = bin_shots([s for s in shots if s.sched < until], t, width)
    normal = []
    for k in range(max(0, int((until - t) / width + 1e-9))):
        p99, n = window_p99(bins.get(k, []), t + k * width, width)
        normal.append(n >= min_n and p99 <= threshold_s)
    return next((k * width for k in range(len(normal) - hold + 1) if all(normal[k:k + hold])), None)


def bucket_rows(shots: list[Shot], samples: list[dict], bucket_s: float, end: float) -> list[dict]:
    """Per bucket of scheduled time: sent / ok / errors / lost, p50 and p99 of the successes (ms), and the last
    resource sample in it."""
    rows, bins = [], bin_shots(shots, 0.0, bucket_s)
    for k in range(max(1, math.ceil(end / bucket_s - 1e-9))):
        mine = bins.get(k, [])
        ok = [s.latency * 1e3 for s in mine if s.outcome == "ok"]
        last = ([x for x in samples if k * bucket_s <= x["t"] < (k + 1) * bucket_s] or [{}])[-1]
        rows.append({"bucket": k, "start_s": k * bucket_s, "sent": len(mine), "ok": len(ok),
                     "errors": sum(1 for s in mine if s.outcome not in ("ok", "lost")),
                     "lost": sum(1 for s in mine if s.outcome == "lost"),
                     "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99),
                     **{key: last.get(key, math.nan) for key in ("server_rss_mb", "client_rss_mb", "loadavg1")},
                     "server_pid": last.get("server_pid", 0)})
    return rows


def serving_samples(samples: list[dict], restarts: list[float], ready_again: list[float]) -> list[dict]:
    """The samples taken while a server served: none from a restart's announcement to its ready-again."""
    spans = [(r, min((t for t in ready_again if t >= r), default=math.inf)) for r in restarts]
    return [x for x in samples if not any(a <= x["t"] <= b for a, b in spans)]


def rss_segments(samples: list[dict], key: str = "server_rss_mb", warmup_s: float = 60.0) -> list[dict]:
    """One row per server pid: its span, first and last MiB, and the drift per minute after its first warmup_s."""
    runs: list[tuple[int, list[tuple[float, float]]]] = []
    for x in samples:
        if not math.isnan(x.get(key, math.nan)):
            if not runs or runs[-1][0] != x.get("server_pid", 0):
                runs.append((x.get("server_pid", 0), []))
            runs[-1][1].append((x["t"], x[key]))
    out = []
    for pid, pts in runs:
        warm = [p for p in pts if p[0] >= pts[0][0] + warmup_s]
        base = warm[0] if len(warm) >= 2 else pts[0]
        minutes = (pts[-1][0] - base[0]) / 60.0
        out.append({"pid": pid, "from_s": pts[0][0], "to_s": pts[-1][0], "start_mb": pts[0][1], "end_mb": pts[-1][1],
                    "drift_from_s": base[0], "per_min_mb": (pts[-1][1] - base[1]) / minutes if minutes else math.nan})
    return out


def rss_drift(samples: list[dict], key: str) -> dict:
    """Start and end of one RSS series (MiB) and its drift per minute over the whole run."""
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


def summarize(res: dict, shots: list[Shot], samples: list[dict], duration_s: float, bucket_s: float) -> dict[str, Any]:
    """Every figure of the soak report from the run's records: the tally, each fault's recovery, RSS, per minute."""
    width = window_width(duration_s)
    base = baseline_p99(shots, 0.0, min((e["at_s"] for e in res["events"]), default=res["end_s"]))
    thr = normal_threshold(base)
    events = []
    for e, upto in zip(res["events"], [e["at_s"] for e in res["events"][1:]] + [res["end_s"] + 1.0], strict=True):
        t = e["at_s"]
        restarted = [(r, why) for r, why in res["restarts"] if r >= t]
        ready = [r for r in res["ready_again"] if r >= t]
        after = [x for x in shots if t <= x.sched < upto]  # from this fault to the next one
        row = {**e, "detected_s": restarted[0][0] - t if restarted else None,
               "reason": restarted[0][1] if restarted else "", "ready_again_s": ready[0] - t if ready else None,
               "first_ok_s": first_ok_after(shots, t),
               "p99_normal_s": p99_back_after(shots, t, thr, width, res["end_s"]),
               "p99_normal_after_end_s": p99_back_after(shots, t + e["length_s"], thr, width, res["end_s"]),
               "errors_after": sum(x.outcome not in ("ok", "lost") for x in after),
               "lost_after": sum(x.outcome == "lost" for x in after)}
        row["recovered"] = "error" not in e and row["first_ok_s"] is not None and row["p99_normal_s"] is not None and (
            e["kind"] == "overload_spike" or row["ready_again_s"] is not None)
        events.append(row)
    counts = tally(shots)
    counts["sent"] = res["created"]
    counts["lost"] += res["unfinished"]  # created but never recorded: no result and no error either
    serving = serving_samples(samples, [r for r, _ in res["restarts"]], res["ready_again"])
    return {"tally": counts, "baseline_p99_s": base, "threshold_s": thr, "window_s": width, "events": events,
            "all_recovered": [e["kind"] for e in events] == list(EVENT_KINDS) and all(e["recovered"] for e in events),
            "server_rss": rss_drift(samples, "server_rss_mb"), "client_rss": rss_drift(samples, "client_rss_mb"),
            "server_segments": rss_segments(serving, "server_rss_mb"), "bucket_s": bucket_s, "end_s": res["end_s"],
            "buckets": bucket_rows(shots, samples, bucket_s, res["end_s"]),
            "loadavg_mean": sum(x["loadavg1"] for x in samples) / max(1, len(samples))}

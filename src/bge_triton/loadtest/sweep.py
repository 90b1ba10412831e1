"""The peak as saturation: a closed-loop concurrency sweep (C users per point) with a server-side probe.

With only C texts in the system no scheduler reaches the GPU's rate on a mixed length mix, so `bench shipped` judges
each path by its highest texts/s over the sweep; a sampler of Triton's statistics checks C really were in flight.
"""
from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

from bge_triton.loadtest.stats import fetch_stats

DEFAULT_SWEEP = "128,512,1024"
# Closed-loop users connect at most this fast (loadgen ramp_s). Triton 2.51's HTTP front end on the 2-core box
# stopped answering (connections held open, nothing queued) when 1100 users connected at once or 1536 over
# 1.5 s; 1024 over 1.5 s was served every time (docs/loadtest.md, "The peak sweep").
CONNECTS_PER_S = 700.0


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'128,512,1024' -> (128, 512, 1024), ascending; an argparse type (bad input: a message naming the fix)."""
    values = []
    for item in map(str.strip, text.split(",")):
        if not item.isdecimal():
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not a whole number; give closed-loop user counts "
                                             "as a comma list, e.g. 128,512,1024")
        values.append(int(item))
    if min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: concurrency {min(values)} must be >= 1 user" if min(values) < 1
                                         else f"{text!r}: a concurrency is listed twice; list each C once")
    return tuple(sorted(values))


def windows(concurrency: int, rate_guess: float, warmup_s: float, duration_s: float,
            max_scale: float = 3.0) -> tuple[float, float, float]:
    """(ramp, warm-up, window) seconds for one point: the C users connect over the ramp (CONNECTS_PER_S), then the
    warm-up covers 1.5 rounds of their C requests at `rate_guess` texts/s (the queue fills and turns over) and
    the window at least 3 rounds; rounds are capped at max_scale x duration_s."""
    ramp = concurrency / CONNECTS_PER_S
    round_s = concurrency / rate_guess if rate_guess > 0 else 0.0
    cap = max_scale * duration_s
    return ramp, ramp + min(max(warmup_s, 1.5 * round_s), cap), min(max(duration_s, 3.0 * round_s), cap)


def window_rates(samples: list[tuple[float, dict[str, float]]], t0: float, t1: float) -> dict[str, float]:
    """Server-side figures over [t0, t1] from timed stats snapshots: completed requests/s and the mean number of
    requests inside Triton (Little: request-seconds, failed ones too, / seconds)."""
    inside = [(t, s) for t, s in samples if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return dict.fromkeys(("server_rate", "server_in_flight", "server_failures"), float("nan"))
    (ta, a), (tb, b) = inside[0], inside[-1]
    dt = tb - ta
    return {"server_rate": (b["success_count"] - a["success_count"]) / dt,
            "server_in_flight": (b["success_ns"] + b.get("fail_ns", 0.0) - a["success_ns"] - a.get("fail_ns", 0.0))
            / 1e9 / dt,
            "server_failures": b["fail_count"] - a["fail_count"]}


class StatsSampler:
    """Polls /v2/models/<model>/stats in a thread every period_s while a load runs (a light GET per period)."""

    def __init__(self, http_url: str, model: str, period_s: float = 0.25):
        self.http_url, self.model, self.period_s = http_url, model, period_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), fetch_stats(self.http_url, self.model)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def peak_sweep(measure: Callable[..., dict], http_url: str, front: str, concurrencies: tuple[int, ...],
               first_rate_guess: float, warmup_s: float, duration_s: float) -> list[dict]:
    """One closed-loop row per C (ascending): measure(users=C, warmup_s=, duration_s=, ramp_s=) -> a core.measure
    row, plus the server-side rate and in-flight count of the called model `front` over the row's window."""
    rows, guess = [], first_rate_guess
    for c in concurrencies:
        ramp, warm, dur = windows(c, guess, warmup_s, duration_s)
        with StatsSampler(http_url, front) as sampler:
            row = measure(users=c, warmup_s=warm, duration_s=dur, ramp_s=ramp)
        row.update(concurrency=c, ramp_s=ramp, warmup_s=warm, window_s=dur,
                   **window_rates(sampler.samples, row["window_start"], row["window_start"] + dur))
        rows.append(row)
        guess = row["throughput"] or guess  # a larger C rarely serves less: the next round is at most C / this
    return rows

"""Load shapes as pure functions of time, users(t): steady, step ramp, tidal and spike (locustfile's --shape).
Free of locust imports (locust monkey-patches at import), so they are unit-tested plainly."""
from __future__ import annotations

import math
from dataclasses import dataclass

from bge_triton.errors import InputError

SHAPES = ("steady", "step", "tidal", "spike")


@dataclass(frozen=True)
class ShapeParams:
    """Peak users and the test length; the other fields shape the curve."""

    peak: int
    duration_s: float
    steps: int = 4  # step ramp: equal steps up to peak
    base_fraction: float = 0.2  # tidal trough and spike baseline, as a fraction of peak
    spike_at: float = 0.5  # spike start, as a fraction of duration
    spike_len: float = 0.15  # spike length, as a fraction of duration


def users_at(shape: str, t: float, p: ShapeParams) -> int | None:
    """Users wanted at t seconds into the test; None once the test is over."""
    if t >= p.duration_s:
        return None
    base = max(1, round(p.base_fraction * p.peak))
    frac = t / p.duration_s
    if shape == "steady":
        return p.peak
    if shape == "step":
        step = min(p.steps, int(frac * p.steps) + 1)
        return max(1, math.ceil(p.peak * step / p.steps))
    if shape == "tidal":  # one day compressed into duration: night trough, midday crest
        return max(1, round(base + (p.peak - base) * (1 - math.cos(2 * math.pi * frac)) / 2))
    if shape == "spike":
        return p.peak if p.spike_at <= frac < p.spike_at + p.spike_len else base
    raise InputError(f"unknown shape {shape!r}: choose one of {SHAPES}")


def spawn_rate(shape: str, p: ShapeParams, requested: float) -> float:
    """How fast to add users: a spike arrives at once, the others at the requested rate."""
    return float(max(requested, p.peak)) if shape == "spike" else float(max(requested, 1.0))

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


def level(shape: str, frac: float, p: ShapeParams = ShapeParams(1, 1.0)) -> float:
    """THE shape curve: the load at `frac` (0..1) of the test, as a fraction of the peak. Locust's users
    (users_at) and the tuner's open-loop rate (loadtest.engine) both follow it."""
    if shape == "steady":
        return 1.0
    if shape == "step":
        return min(p.steps, int(frac * p.steps) + 1) / p.steps
    if shape == "tidal":  # one day compressed into the test: night trough, midday crest
        return p.base_fraction + (1 - p.base_fraction) * (1 - math.cos(2 * math.pi * frac)) / 2
    if shape == "spike":
        return 1.0 if p.spike_at <= frac < p.spike_at + p.spike_len else p.base_fraction
    raise InputError(f"unknown shape {shape!r}: choose one of {SHAPES}")


def users_at(shape: str, t: float, p: ShapeParams) -> int | None:
    """Users wanted at t seconds into the test (level() of the peak); None once the test is over."""
    if t >= p.duration_s:
        return None
    frac, base = t / p.duration_s, max(1, round(p.base_fraction * p.peak))
    if shape == "step":
        return max(1, math.ceil(p.peak * level(shape, frac, p)))
    if shape in ("tidal", "spike"):  # the trough never below the rounded base
        return max(base, round(p.peak * level(shape, frac, p)))
    return max(1, round(p.peak * level(shape, frac, p)))


def spawn_rate(shape: str, p: ShapeParams, requested: float) -> float:
    """How fast to add users: a spike arrives at once, the others at the requested rate."""
    return float(max(requested, p.peak)) if shape == "spike" else float(max(requested, 1.0))

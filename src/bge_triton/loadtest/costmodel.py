"""The calibrated cost model t(B, L) = a + b*B*L behind the `costmodel` executor (an emulated GPU).

The default is fitted to the seed's A10G rows at L=64 (batch 1: 145 QPS; static batch 32: 1200 QPS); another card's
a and b go to the bench and the tuner as --cost-a-us / --cost-b-us (fit them to its GPU bench's compute column).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bge_triton.errors import InputError


@dataclass(frozen=True)
class ProfilePoint:
    """One measured (or published) batch: B texts of L tokens took ms milliseconds of compute."""

    batch: int
    seq_len: int
    ms: float


@dataclass(frozen=True)
class CostModel:
    """t(B, L) = a_us + b_us * B * L microseconds per Triton batch."""

    a_us: float
    b_us: float
    rmse_ms: float = 0.0
    source: str = "seed A10G rows"

    def batch_ms(self, batch: int, seq_len: float) -> float:
        return (self.a_us + self.b_us * batch * seq_len) / 1000.0

    def capacity_qps(self, batch: int, seq_len: int) -> float:
        """Requests per second one instance sustains at a fixed batch size."""
        return batch * 1000.0 / self.batch_ms(batch, seq_len)

    def variant_kwargs(self) -> dict[str, float]:
        """Keyword arguments for server.cpu_variant.CpuVariant."""
        return {"cost_a_us": round(self.a_us, 1), "cost_b_us": round(self.b_us, 4)}


def fit(points: list[ProfilePoint] | tuple[ProfilePoint, ...], source: str = "profile") -> CostModel:
    """Least-squares fit of a and b (both >= 0) to profile points; needs two distinct B*L values."""
    if len({p.batch * p.seq_len for p in points}) < 2:
        raise InputError(f"a cost-model fit needs points at two or more distinct batch*seq_len values, got "
                         f"{[(p.batch, p.seq_len) for p in points]}: profile more batch sizes")
    x = np.array([p.batch * p.seq_len for p in points], dtype=float)
    y = np.array([p.ms * 1000.0 for p in points], dtype=float)
    b, a = np.polyfit(x, y, 1)
    if b < 0:  # cost cannot fall with more tokens: flat model
        a, b = float(y.mean()), 0.0
    if a < 0:  # no negative fixed cost: fit through the origin
        a, b = 0.0, float((x @ y) / (x @ x))
    rmse = float(np.sqrt(np.mean((a + b * x - y) ** 2))) / 1000.0
    return CostModel(float(a), float(b), rmse, source)


# the published seed rows (A10G, BGE-Large-zh, L=64): time per batch = B / throughput
DEFAULT = fit((ProfilePoint(1, 64, 1000.0 / 145.0), ProfilePoint(32, 64, 32000.0 / 1200.0)),
              "seed A10G rows (batch 1: 145 QPS, static 32: 1200 QPS, L=64)")

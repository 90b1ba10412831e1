"""Overload scenario: Poisson load at a multiple of the measured capacity against a server with a deterministic
encoder (the costmodel executor: t = a + b*B*L, an emulated GPU), through the kit's AsyncEmbeddingClient.

Phases: baseline (0.3x) -> overload (factor x) -> recovery (0.3x). Every request gets an outer deadline; one
that outlives it is lost. Latency counts from the SCHEDULED send time. A second overload pass uses the client's
RetryPolicy and counts the attempts it really sends.
"""
from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from bge_triton.client import AsyncEmbeddingClient, Overloaded, RetryPolicy
from bge_triton.loadtest import harness, loadgen
from bge_triton.loadtest.chaos_faults import PORT_RANGE, capacity
from bge_triton.loadtest.stats import percentile, tree_rss_mb
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import http_ready
from bge_triton.server.repository import Batching

TEXT = "hello world"  # [CLS] hello world [SEP]: 4 tokens, padded to 8 -> a fixed cost per text


@dataclass(frozen=True)
class OverloadSettings:
    """Knobs of the overload scenario."""

    repository: Path
    state_dir: Path
    model: str = "minilm"
    factor: float = 3.0
    overload_s: float = 60.0
    baseline_s: float = 4.0
    recovery_s: float = 6.0
    low_factor: float = 0.3
    deadline_s: float = 5.0  # the caller's deadline per request (client timeout_s)
    cost_a_us: float = 1000.0
    cost_b_us: float = 2500.0  # 8 padded tokens x 2.5 ms = 20 ms per text: ~50 texts/s on one instance
    max_batch: int = 8
    queue_timeout_ms: int = 500
    max_queue_size: int = 64
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=3, initial_backoff_s=0.05,
                                                                     max_backoff_s=0.5, total_s=5.0))
    seed: int = 0

    def variant(self) -> CpuVariant:
        """Queue policy on both models: a bounded queue and a REJECT timeout."""
        knobs = Batching(max_batch_size=self.max_batch, preferred_batch_sizes=(), max_queue_delay_us=0,
                         max_queue_size=self.max_queue_size, queue_timeout_us=self.queue_timeout_ms * 1000)
        return CpuVariant(executor="costmodel", cost_a_us=self.cost_a_us, cost_b_us=self.cost_b_us,
                          batching={self.model: knobs, f"{self.model}_onnx": knobs},
                          text_params={"sub_batch_max": str(self.max_batch)})

    @property
    def latency_bound_s(self) -> float:
        """What the queue policy allows an ACCEPTED request: both queue timeouts + one batch each + slack."""
        return 2 * self.queue_timeout_ms / 1000 + 2 * (self.cost_a_us + self.cost_b_us * self.max_batch * 8) / 1e6 + 0.5


@dataclass
class Shot:
    phase: str
    sched: float  # seconds since the run began
    latency: float
    outcome: str  # "ok", errors.kind_of(error), or "lost"
    attempts: int = 1


_ATTEMPTS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("attempts")


def _count_attempts(client: AsyncEmbeddingClient) -> None:
    """Wrap the client's transport.infer to count the attempts really sent (retries included) per request (a context
    variable set by each request's task)."""
    infer = client._transport.infer

    async def counting(call, timeout_s):
        if (mine := _ATTEMPTS.get(None)) is not None:
            mine[0] += 1
        return await infer(call, timeout_s)

    client._transport.infer = counting


async def _storm(client: AsyncEmbeddingClient, phases: list[tuple[str, float, float]], deadline_s: float,
                 rng: random.Random) -> list[Shot]:
    """Poisson arrivals, phases = [(name, rate_rps, seconds)] back to back; one Shot per request, none left out."""
    t0, shots = time.monotonic(), []
    attempts: dict[float, list[int]] = {}  # send time -> [attempts sent]
    ends = [sum(s for _, _, s in phases[:k + 1]) for k in range(len(phases))]

    def now() -> float:
        return time.monotonic() - t0

    async def times() -> AsyncIterator[float]:
        for (_, rate, _), start, end in zip(phases, [0.0, *ends], ends, strict=False):
            async for t in loadgen.poisson(rng, partial(float, rate), now, start, end, yield_when_late=False):
                yield t

    async def call(t: float) -> None:
        _ATTEMPTS.set(attempts.setdefault(t, [0]))
        await client.embed_documents([TEXT], timeout_s=deadline_s)

    def record(t: float, done: float, kind: str, _error: BaseException | None) -> None:
        phase = phases[next(k for k, end in enumerate(ends) if t < end)][0]
        shots.append(Shot(phase, t, done - t, kind, attempts.pop(t, [1])[0]))

    await loadgen.open_loop(call, times(), now, record, deadline_s + 2.0)
    return shots


def recovery_time(shots: list[Shot], drop_at: float, normal_s: float) -> float:
    """Seconds from the load drop until the last abnormal answer (error, or latency above normal_s)."""
    return max((s.sched + s.latency - drop_at for s in shots
                if s.phase == "recovery" and (s.outcome != "ok" or s.latency > normal_s)), default=0.0)


async def _run(settings: OverloadSettings, url: str, pid: int) -> dict:
    rng = random.Random(settings.seed)
    async with AsyncEmbeddingClient(url, model=settings.model, retry=RetryPolicy.off(),
                                    timeout_s=settings.deadline_s) as client:
        _count_attempts(client)
        warm = 0
        for _ in range(50):  # the first calls are slow (stub start-up) and may hit the queue timeout
            try:
                await client.embed_documents([TEXT])
                warm += 1
            except Overloaded:
                await asyncio.sleep(0.2)
            if warm >= 5:
                break
        cap = await capacity(lambda _k: client.embed_documents([TEXT]), 3.0, 16, 0.01)
        low, high = settings.low_factor * cap, settings.factor * cap
        rss_before = tree_rss_mb(pid)
        shots = await _storm(client, [("baseline", low, settings.baseline_s), ("overload", high, settings.overload_s),
                                      ("recovery", low, settings.recovery_s)], settings.deadline_s, rng)
    base = [s.latency for s in shots if s.phase == "baseline" and s.outcome == "ok"]
    base_p50 = percentile(base, 50) if base else 0.05
    normal_s = max(3 * base_p50, percentile(base, 99) * 1.5 if base else 0.1, 0.1)
    over = [s for s in shots if s.phase == "overload"]
    accepted = [s.latency for s in over if s.outcome == "ok"]
    rejected = [s.latency for s in over if s.outcome == "Overloaded"]
    # the same storm with retries on: attempts per request must stay bounded by max_attempts
    async with AsyncEmbeddingClient(url, model=settings.model, retry=settings.retry,
                                    timeout_s=settings.deadline_s) as client:
        _count_attempts(client)
        retried = await _storm(client, [("retry", high, min(settings.overload_s, 10.0))], settings.deadline_s, rng)
    return {
        "capacity_rps": cap, "offered_rps": high, "factor": settings.factor,
        "overload_s": settings.overload_s, "deadline_s": settings.deadline_s,
        "requests": len(shots), "outcomes": dict(Counter(s.outcome for s in shots)),
        "overload_outcomes": dict(Counter(s.outcome for s in over)),
        "lost": sum(s.outcome == "lost" for s in shots),
        "baseline_p50_s": base_p50, "normal_s": normal_s,
        "accepted_p99_s": percentile(accepted, 99) if accepted else 0.0,
        "accepted_max_s": max(accepted, default=0.0), "latency_bound_s": settings.latency_bound_s,
        "rejected_p99_s": percentile(rejected, 99) if rejected else 0.0,
        "rejected_max_s": max(rejected, default=0.0),
        "recovery_s": recovery_time(shots, settings.baseline_s + settings.overload_s, normal_s),
        "rss_growth_mb": tree_rss_mb(pid) - rss_before,
        "retry_requests": len(retried), "retry_attempts": sum(s.attempts for s in retried),
        "retry_max_attempts_seen": max((s.attempts for s in retried), default=0),
        "retry_policy_max_attempts": settings.retry.max_attempts,
        "retry_outcomes": dict(Counter(s.outcome for s in retried)),
        "shots": shots,
    }


def run_overload(settings: OverloadSettings) -> dict:
    """Start a costmodel server we own, run the phases, stop it; returns the figures (and every shot)."""
    srv = harness.start_server(settings.repository, settings.state_dir, settings.variant(), port_range=PORT_RANGE)
    try:
        result = asyncio.run(_run(settings, srv.grpc_url, srv.pid))
        result["server_alive_after"] = srv.running.poll() is None
        result["server_ready_after"] = http_ready(srv.settings.http_port)
        return result
    finally:
        srv.stop()

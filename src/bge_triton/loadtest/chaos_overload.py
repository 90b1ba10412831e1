"""Overload scenario: open-loop load at a multiple of the measured capacity against a server with a
deterministic encoder (the costmodel executor: t = a + b*B*L, an emulated GPU), through the kit's
AsyncEmbeddingClient.

Phases: baseline (0.3x) -> overload (factor x) -> recovery (0.3x). Every request gets an outer
deadline; a request that outlives it is a hang. Latency counts from the SCHEDULED send time.
A second overload pass uses the client's RetryPolicy and counts the attempts it really sends.
"""
from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from bge_triton.client import AsyncEmbeddingClient, InputError, KitError, Overloaded, RetryPolicy, ServerUnavailable
from bge_triton.errors import Timeout
from bge_triton.loadtest import loadgen
from bge_triton.loadtest.chaos_common import start_server, tree_rss_mb
from bge_triton.loadtest.stats import percentile
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.repository import Batching

TEXT = "hello world"  # [CLS] hello world [SEP]: 4 tokens, padded to 8 -> a fixed cost per text


@dataclass(frozen=True)
class OverloadSettings:
    """Knobs of the overload scenario; `quick` shortens the phases for CI."""

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
                         max_queue_size=self.max_queue_size,
                         queue_timeout_us=self.queue_timeout_ms * 1000)
        return CpuVariant(executor="costmodel", cost_a_us=self.cost_a_us, cost_b_us=self.cost_b_us,
                          batching={self.model: knobs, f"{self.model}_onnx": knobs},
                          text_params={"sub_batch_max": str(self.max_batch)})

    @property
    def latency_bound_s(self) -> float:
        """What the queue policy allows an ACCEPTED request: both queue timeouts + one batch each + slack."""
        batch_s = (self.cost_a_us + self.cost_b_us * self.max_batch * 8) / 1e6
        return 2 * self.queue_timeout_ms / 1000 + 2 * batch_s + 0.5


@dataclass
class Shot:
    phase: str
    sched: float  # seconds since the run began
    latency: float
    outcome: str  # ok | overloaded | unavailable | timeout | input | other | hung
    attempts: int = 1


def _kind(exc: BaseException) -> str:
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, Timeout):
        return "timeout"
    if isinstance(exc, ServerUnavailable):
        return "unavailable"
    if isinstance(exc, InputError):
        return "input"
    if isinstance(exc, KitError):
        return "other"
    return f"raw:{type(exc).__name__}"


_ATTEMPTS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("attempts")


class _Counting:
    """Wraps the client's transport.infer to count the attempts really sent (retries included),
    in total and per request (a context variable set by each request's task)."""

    def __init__(self, infer):
        self.infer, self.count = infer, 0

    async def __call__(self, call, timeout_s):
        self.count += 1
        mine = _ATTEMPTS.get(None)
        if mine is not None:
            mine[0] += 1
        return await self.infer(call, timeout_s)


async def _open_loop(client: AsyncEmbeddingClient, phases: list[tuple[str, float, float]], deadline_s: float,
                     counter: _Counting, rng: random.Random) -> list[Shot]:
    """Poisson arrivals; phases = [(name, rate_rps, seconds)]. Returns one Shot per request, none lost."""
    shots: list[Shot] = []
    tasks = []
    t0 = time.monotonic()

    async def one(phase: str, sched: float) -> None:
        mine = [0]
        _ATTEMPTS.set(mine)
        try:
            await asyncio.wait_for(client.embed_documents([TEXT], timeout_s=deadline_s), deadline_s + 2.0)
            outcome = "ok"
        except asyncio.TimeoutError:
            outcome = "hung"
        except Exception as exc:
            outcome = _kind(exc)
        shots.append(Shot(phase, sched, time.monotonic() - t0 - sched, outcome, mine[0]))

    start = 0.0
    for name, rate, seconds in phases:
        async for t in loadgen.poisson(rng, partial(float, rate), lambda: time.monotonic() - t0, start,
                                       start + seconds, yield_when_late=False):
            tasks.append(asyncio.ensure_future(one(name, t)))
        start += seconds
    await asyncio.gather(*tasks)
    return shots


async def _capacity(client: AsyncEmbeddingClient, seconds: float = 3.0, users: int = 16) -> float:
    """Texts per second the server sustains closed-loop (with queue headroom)."""
    done = 0
    stop = time.monotonic() + seconds

    async def user() -> None:
        nonlocal done
        while time.monotonic() < stop:
            try:
                await client.embed_documents([TEXT])
                done += 1
            except KitError:
                await asyncio.sleep(0.01)

    t = time.monotonic()
    await asyncio.gather(*(user() for _ in range(users)))
    return done / (time.monotonic() - t)


def recovery_time(shots: list[Shot], drop_at: float, normal_s: float) -> float:
    """Seconds from the load drop until the last abnormal answer (error, or latency above normal_s)."""
    worst = 0.0
    for s in shots:
        if s.phase == "recovery" and (s.outcome != "ok" or s.latency > normal_s):
            worst = max(worst, s.sched + s.latency - drop_at)
    return worst


async def _run(settings: OverloadSettings, url: str, pid: int) -> dict:
    rng = random.Random(settings.seed)
    async with AsyncEmbeddingClient(url, model=settings.model, retry=RetryPolicy.off(),
                                    timeout_s=settings.deadline_s) as client:
        counter = _Counting(client._transport.infer)
        client._transport.infer = counter
        warm = 0
        for _ in range(50):  # the first calls are slow (stub start-up) and may hit the queue timeout
            try:
                await client.embed_documents([TEXT])
                warm += 1
            except Overloaded:
                await asyncio.sleep(0.2)
            if warm >= 5:
                break
        capacity = await _capacity(client)
        low, high = settings.low_factor * capacity, settings.factor * capacity
        phases = [("baseline", low, settings.baseline_s), ("overload", high, settings.overload_s),
                  ("recovery", low, settings.recovery_s)]
        rss_before = tree_rss_mb(pid)
        shots = await _open_loop(client, phases, settings.deadline_s, counter, rng)
    base = [s.latency for s in shots if s.phase == "baseline" and s.outcome == "ok"]
    base_p50 = percentile(base, 50) if base else 0.05
    normal_s = max(3 * base_p50, percentile(base, 99) * 1.5 if base else 0.1, 0.1)
    drop_at = settings.baseline_s + settings.overload_s
    over = [s for s in shots if s.phase == "overload"]
    accepted = [s.latency for s in over if s.outcome == "ok"]
    rejected = [s.latency for s in over if s.outcome == "overloaded"]
    # the same storm with retries on: attempts per request must stay bounded by max_attempts
    async with AsyncEmbeddingClient(url, model=settings.model, retry=settings.retry,
                                    timeout_s=settings.deadline_s) as client:
        counter2 = _Counting(client._transport.infer)
        client._transport.infer = counter2
        retry_s = min(settings.overload_s, 10.0)
        retried = await _open_loop(client, [("retry", high, retry_s)], settings.deadline_s, counter2, rng)
    return {
        "capacity_rps": capacity, "offered_rps": high, "factor": settings.factor,
        "overload_s": settings.overload_s, "deadline_s": settings.deadline_s,
        "requests": len(shots), "outcomes": dict(Counter(s.outcome for s in shots)),
        "overload_outcomes": dict(Counter(s.outcome for s in over)),
        "hung": sum(s.outcome == "hung" for s in shots),
        "baseline_p50_s": base_p50, "normal_s": normal_s,
        "accepted_p99_s": percentile(accepted, 99) if accepted else 0.0,
        "accepted_max_s": max(accepted, default=0.0), "latency_bound_s": settings.latency_bound_s,
        "rejected_p99_s": percentile(rejected, 99) if rejected else 0.0,
        "rejected_max_s": max(rejected, default=0.0),
        "recovery_s": recovery_time(shots, drop_at, normal_s),
        "rss_growth_mb": tree_rss_mb(pid) - rss_before,
        "retry_requests": len(retried), "retry_attempts": sum(s.attempts for s in retried),
        "retry_max_attempts_seen": max((s.attempts for s in retried), default=0),
        "retry_policy_max_attempts": settings.retry.max_attempts,
        "retry_outcomes": dict(Counter(s.outcome for s in retried)),
        "shots": shots,
    }


def run_overload(settings: OverloadSettings) -> dict:
    """Start a costmodel server we own, run the phases, stop it; returns the figures (and every shot)."""
    srv = start_server(settings.repository, settings.state_dir, settings.variant())
    try:
        result = asyncio.run(_run(settings, srv.grpc_url, srv.pid))
        result["server_alive_after"] = srv.running.poll() is None
        import urllib.request

        with urllib.request.urlopen(f"http://{srv.http_url}/v2/health/ready", timeout=5) as resp:
            result["server_ready_after"] = resp.status == 200
        return result
    finally:
        srv.stop()

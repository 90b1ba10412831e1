"""THE load engine of every benchmark: `drive` offers a closed, open (Poisson) or shaped load (shapes.level) to any
async caller and records each request's outcome, latency counted from the SCHEDULED send time (no coordinated
omission); its pieces, the schedule (`poisson`) and the two loops (`open_loop`, `closed_loop`), serve the scenarios
that drive their own callers (chaos, soak, faults). Its callers: raw keep-alive HTTP (loadgen.run, the SDK's bytes,
several processes) and tritonclient's asyncio clients (loadtest.engine, against a running Triton)."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from bge_triton.errors import kind_of
from bge_triton.loadtest import shapes


async def poisson(rng: random.Random, rate: Callable[[], float], now: Callable[[], float], start: float,
                  until: float = math.inf, yield_when_late: bool = True) -> AsyncIterator[float]:
    """THE open-loop Poisson schedule: send times in [start, until) on the `now` clock at `rate()` per second, each
    yielded when it comes (behind schedule: at once, after one loop turn unless yield_when_late is False)."""
    t = start
    while (t := t + rng.expovariate(rate())) < until:
        if (delay := t - now()) > 0 or yield_when_late:
            await asyncio.sleep(max(0.0, delay))
        yield t


Record = Callable[[float, float, str, "BaseException | None"], None]  # (send time or user, done, kind, error)


async def open_loop(call: Callable[[float], Awaitable[object]], times: AsyncIterator[float],
                    now: Callable[[], float], record: Record, deadline_s: float = math.inf,
                    give_up_at: float = math.inf) -> int:
    """Start call(t) at each send time t of `times` (poisson); record(t, now(), kind, error) when it ends: "ok",
    errors.kind_of(exc), or "lost" (no answer within deadline_s, nor by give_up_at on the `now` clock). Returns the
    count sent, once all have ended."""
    async def one(t: float) -> None:
        task = asyncio.ensure_future(call(t))
        wait = min(deadline_s, give_up_at - now())
        done, _ = await asyncio.wait({task}, timeout=max(0.0, wait) if math.isfinite(wait) else None)
        if not done:  # lost (a TimeoutError the call raises is its own kind)
            task.cancel()
        error = task.exception() if done else None
        record(t, now(), "lost" if not done else kind_of(error), error)

    pending: set[asyncio.Future[None]] = set()  # only the unfinished: a soak sends 400k, its RSS is the SDK's
    sent = 0
    async for t in times:
        pending.add(task := asyncio.ensure_future(one(t)))
        task.add_done_callback(pending.discard)
        sent += 1
    await asyncio.gather(*pending)
    return sent


async def closed_loop(call: Callable[[int], Awaitable[object]], users: int, until: Callable[[], bool],
                      record: Record | None = None, pause_s: float = 0.0,
                      now: Callable[[], float] = time.monotonic) -> int:
    """`users` users, user k awaiting call(k) back to back until until(), pause_s after an error; record(k, now(),
    kind, error) per request when given. Returns the successes."""
    ok = 0

    async def user(k: int) -> None:
        nonlocal ok
        while not until():
            try:
                await call(k)
                ok += 1
                kind, error = "ok", None
            except Exception as exc:
                kind, error = kind_of(exc), exc
            if record is not None:
                record(k, now(), kind, error)
            if error is not None:
                await asyncio.sleep(pause_s)

    await asyncio.gather(*(user(k) for k in range(users)))
    return ok


@dataclass(frozen=True)
class Load:
    """One offered load: `users` closed-loop callers, or `rate` arrivals/s (open loop), shaped by `shape`."""

    users: int = 0
    rate: float = 0.0
    shape: str = "steady"  # open loop: steady, or a shapes.SHAPES curve over the window peaking at `rate`

    @property
    def label(self) -> str:
        return f"C={self.users}" if self.users else (f"{self.rate:g}/s" + ("" if self.shape == "steady" else
                                                                          f" {self.shape}"))

    def rate_at(self, frac: float) -> float:
        """The open loop's arrival rate at `frac` (0..1) of the window: shapes.level of the peak (at least 0.05/s)."""
        return self.rate if self.shape == "steady" else max(0.05, self.rate * shapes.level(self.shape, frac))


async def drive(call: Callable[[int], Awaitable[object]], load: Load, now: Callable[[], float], begin: float,
                end: float, record: Record, *, until: Callable[[float], bool] | None = None, seed: int = 7,
                start: float | None = None, ramp_s: float = 0.0, grace_s: float = math.inf) -> int:
    """THE load engine. `load.users` users calling back to back (closed_loop; user k joins k/users x ramp_s after
    `start`), or Poisson arrivals (poisson + open_loop) at load.rate_at(the window's fraction in [begin, end]), from
    `start` (default: now) until until(send time) (default: `end`); call(i) with a running request index i.
    record(sent, done, kind, error) per request: sent = the scheduled time (open) or the send (closed); kind "lost"
    for a request still unanswered at end + grace_s (cancelled then). Returns the count sent."""
    stop, index, t0 = until or (lambda t: t >= end), itertools.count(), now() if start is None else start
    length = max(end - begin, 1e-9)
    if load.users:
        sent_at: dict[int, float] = {}

        async def user_call(k: int) -> None:
            if k not in sent_at and (delay := t0 + ramp_s * k / load.users - now()) > 0:
                await asyncio.sleep(delay)  # a ramp: Triton 2.51's HTTP front end stalled on 1100 connects at once
            sent_at[k] = now()
            try:
                await call(next(index))
            except asyncio.CancelledError:
                record(sent_at[k], now(), "lost", None)
                raise

        users = asyncio.ensure_future(closed_loop(user_call, load.users, lambda: stop(now()),
                                                  lambda k, done, kind, error: record(sent_at[int(k)], done, kind,
                                                                                      error), now=now))
        if not (await asyncio.wait({users}, timeout=end + grace_s - now() if math.isfinite(grace_s) else None))[0]:
            users.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await users
        return next(index)

    async def arrivals() -> AsyncIterator[float]:
        rate = lambda: load.rate_at(min(max(now() - begin, 0.0), length) / length)  # noqa: E731
        async for t in poisson(random.Random(seed), rate, now, t0, math.inf, False):
            if stop(t):
                return
            yield t

    return await open_loop(lambda _t: call(next(index)), arrivals(), now, record, give_up_at=end + grace_s)

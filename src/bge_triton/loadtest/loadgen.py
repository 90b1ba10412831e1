"""The kit's one load driver: raw keep-alive HTTP with the SDK's own request bytes, and the loops over any async caller.
Closed loop: C users back to back; open loop: Poisson arrivals, latency counted from the SCHEDULED send time (no
coordinated omission). `processes` > 1 splits the load over spawned processes sharing one wall-clock window."""
from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing as mp
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from bge_triton.client.core import InferCall, tensor_call, text_call
from bge_triton.client.wire import http_request
from bge_triton.errors import InputError, kind_of


def request_body(call: InferCall) -> bytes:
    """The SDK's own HTTP body for `call` (client.wire.http_request), its header length framed in front."""
    body, header_len = http_request(call)
    return header_len.to_bytes(8, "little") + body


def text_request(text: str, truncate: bool = True) -> bytes:
    """One text-endpoint request as the SDK's text mode sends it: text BYTES [1, 1] plus `truncate`."""
    return request_body(text_call("", [text], truncate))


def tensor_bodies(seq_len: int, n: int = 128, vocab: int = 1000, seed: int = 0) -> list[bytes]:
    """n distinct encoder requests as the SDK's tensor mode sends them: input_ids and attention_mask INT64 [1, L]."""
    rows = np.random.default_rng(seed).integers(1, vocab, (n, 1, seq_len), dtype=np.int64)
    return [request_body(tensor_call("", row, np.ones_like(row))) for row in rows]


@dataclass(frozen=True)
class LoadSpec:
    """One load run; picklable so it can be split over processes."""

    host: str
    port: int
    model: str
    bodies: tuple[bytes, ...]
    mode: str = "closed"  # or "open"
    concurrency: int = 32  # closed: users; open: max connections
    rate: float = 100.0  # open: arrivals per second
    warmup_s: float = 1.0
    duration_s: float = 5.0
    grace_s: float = 5.0  # wait this long after the window for late answers (closed: then the users are stopped)
    ramp_s: float = 0.0  # closed: user k starts at k/C x ramp_s (keep it inside warmup_s)
    processes: int = 1
    seed: int = 0
    t0: float = 0.0  # wall clock start (set by run)


@dataclass
class LoadResult:
    """Requests that belong to the window: closed = completed in it, open = scheduled in it."""

    window_s: float = 0.0
    ok: int = 0  # completions inside the window (throughput = ok / window_s)
    latencies_ms: list = field(default_factory=list)
    errors: int = 0
    late: int = 0  # open loop: scheduled in the window, no answer within the grace
    first_error: str = ""
    window_start: float = 0.0  # wall clock (time.time()) of the window's start, for samplers of other probes
    loop_lag_ms: float = 0.0  # closed: mean lateness of a 10 ms timer in the window (answers wait this long unread)
    loop_lag_max_ms: float = 0.0

    @property
    def throughput(self) -> float:
        return self.ok / self.window_s if self.window_s else 0.0

    def merge(self, other: LoadResult) -> None:
        self.ok += other.ok
        self.latencies_ms.extend(other.latencies_ms)
        self.errors += other.errors
        self.late += other.late
        self.first_error = self.first_error or other.first_error
        self.loop_lag_ms = max(self.loop_lag_ms, other.loop_lag_ms)  # the busiest process's event loop
        self.loop_lag_max_ms = max(self.loop_lag_max_ms, other.loop_lag_max_ms)


class _Conn:
    """One keep-alive HTTP/1.1 connection to Triton."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter | None = None

    def __init__(self, spec: LoadSpec):
        self.spec = spec
        self.prefix = (f"POST /v2/models/{spec.model}/infer HTTP/1.1\r\nHost: {spec.host}\r\n"
                       "Content-Type: application/octet-stream\r\n").encode()

    async def infer(self, body: bytes) -> str:
        """'' on success, else a short error text (never raises)."""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.spec.host, self.spec.port)
            hlen, payload = int.from_bytes(body[:8], "little"), body[8:]
            self.writer.write(self.prefix + f"Inference-Header-Content-Length: {hlen}\r\n"
                              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            status, length = await self.reader.readline(), 0
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            data = await self.reader.readexactly(length)
            code = int(status.split()[1]) if status else 0
            return "" if code == 200 else f"HTTP {code}: {data[:200].decode(errors='replace')}"
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            self.close()
            return f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer = None


def ensure_open_files(connections: int, margin: int = 256) -> None:
    """Raise the soft open-file limit to hold `connections` sockets (else EMFILE errors), or fail naming the fix."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + margin
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise InputError(f"{connections} connections need {need} open files but the hard limit is {hard}: raise "
                             f"it (`ulimit -Hn {need}` as root, or LimitNOFILE) or split the load (processes > 1)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


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
                    now: Callable[[], float], record: Record, deadline_s: float = math.inf) -> int:
    """Start call(t) at each send time t of `times` (poisson); record(t, now(), kind, error) when it ends: "ok",
    errors.kind_of(exc), or "lost" (no answer within deadline_s). Returns the count sent, once all have ended."""
    async def one(t: float) -> None:
        task = asyncio.ensure_future(call(t))
        done, _ = await asyncio.wait({task}, timeout=deadline_s if math.isfinite(deadline_s) else None)
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


async def _run_async(spec: LoadSpec) -> LoadResult:
    ensure_open_files(spec.concurrency)
    begin = spec.t0 + spec.warmup_s
    end = begin + spec.duration_s
    res = LoadResult(window_s=spec.duration_s)
    loop = asyncio.get_running_loop()
    base = loop.time() - (time.time() - spec.t0)

    def clock() -> float:  # the loop clock on the shared wall scale
        return spec.t0 + (loop.time() - base)

    idle: list[_Conn] = []  # keep-alive connections not in use (closed loop: one per user)
    sem = asyncio.Semaphore(spec.concurrency)

    async def send(sched: float, i: int) -> None:
        async with sem:
            conn = idle.pop() if idle else _Conn(spec)
            try:
                err = await conn.infer(spec.bodies[i % len(spec.bodies)])
            finally:
                idle.append(conn)
        done = clock()
        in_window = begin <= (sched if spec.mode == "open" else done) <= end
        if err:
            res.errors += in_window
            res.first_error = res.first_error or err
            return
        res.ok += begin <= done <= end
        if in_window:
            res.latencies_ms.append((done - sched) * 1000.0)

    async def settle(tasks: set[asyncio.Task]) -> int:  # the grace after the window; then the unanswered are late
        _, late = await asyncio.wait(tasks, timeout=max(0.0, end + spec.grace_s - clock())) if tasks else ((), ())
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        res.late = len(late)
        return res.late

    if spec.mode == "closed":
        async def user(k: int) -> None:
            if (start := spec.t0 + spec.ramp_s * k / spec.concurrency - clock()) > 0:
                await asyncio.sleep(start)  # a ramp: Triton 2.51's HTTP front end stalled on 1100 connects at once
            for i in itertools.count(k, spec.concurrency):
                if (now := clock()) >= end:
                    return
                await send(now, i)

        async def lag_probe() -> None:  # a busy loop leaves answers unread: they are out of the server, not in it
            lags = []
            while (now := clock()) < end:
                await asyncio.sleep(0.01)
                if now >= begin:
                    lags.append(max(0.0, clock() - now - 0.01) * 1000.0)
            res.loop_lag_ms = sum(lags) / len(lags) if lags else 0.0
            res.loop_lag_max_ms = max(lags, default=0.0)

        probe = asyncio.create_task(lag_probe())
        if stuck := await settle({asyncio.create_task(user(k)) for k in range(spec.concurrency)}):
            res.first_error = res.first_error or (f"{stuck} requests unanswered {spec.grace_s:g} s after the "
                                                  "window (the server stopped answering)")
        await probe
    else:
        pending: set[asyncio.Task] = set()
        n = itertools.count()
        async for sched in poisson(random.Random(spec.seed), lambda: spec.rate, clock, clock(), end, False):
            pending.add(task := asyncio.create_task(send(sched, next(n))))
            task.add_done_callback(pending.discard)
        await settle(set(pending))
    for conn in idle:
        conn.close()
    return res


def _child(spec: LoadSpec, queue) -> None:
    queue.put(asyncio.run(_run_async(spec)))


def run(spec: LoadSpec) -> LoadResult:
    """Run the load (split over spec.processes) and return the merged window result."""
    n = max(1, spec.processes)
    t0 = time.time() + (0.3 if n == 1 else 1.5)  # spawned children need time to import
    parts = [LoadSpec(**{**spec.__dict__, "concurrency": max(1, spec.concurrency // n), "rate": spec.rate / n,
                         "processes": 1, "seed": spec.seed + k, "t0": t0}) for k in range(n)]
    total = LoadResult(window_s=spec.duration_s, window_start=t0 + spec.warmup_s)
    if n == 1:
        total.merge(asyncio.run(_run_async(parts[0])))
        return total
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(p, queue), daemon=True) for p in parts]
    for p in procs:
        p.start()
    for _ in procs:
        total.merge(queue.get(timeout=spec.warmup_s + spec.duration_s + spec.grace_s + 60))
    for p in procs:
        p.join(timeout=10)
    return total

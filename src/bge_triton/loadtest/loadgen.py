"""The raw keep-alive HTTP caller of the load engine (loadtest.loops.drive) with the SDK's own request bytes: `run`
offers a LoadSpec's load over raw sockets, `processes` > 1 splitting it over spawned processes that share one
wall-clock window; it stays beside the tritonclient caller (loadtest.engine) because it is the one transport that
saturates a server from these cores. The engine's loops are re-exported here (loadgen.open_loop, ...)."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass, field

import numpy as np

from bge_triton.client.core import InferCall, tensor_call, text_call
from bge_triton.client.wire import http_request
from bge_triton.errors import InputError
from bge_triton.loadtest.loops import Load as Load
from bge_triton.loadtest.loops import Record as Record
from bge_triton.loadtest.loops import closed_loop as closed_loop
from bge_triton.loadtest.loops import drive
from bge_triton.loadtest.loops import open_loop as open_loop
from bge_triton.loadtest.loops import poisson as poisson


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
    rate: float = 100.0  # open: arrivals per second (at the peak of `shape`)
    shape: str = "steady"  # open: steady, or a shapes.SHAPES curve over the window
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


class _Failed(Exception):
    """A raw HTTP request that came back without a 200 (its text: the status and the body's start)."""


async def _run_async(spec: LoadSpec) -> LoadResult:
    """The engine (`drive`) over raw keep-alive HTTP: one connection per user (closed) or up to spec.concurrency
    (open). Closed: the requests completed in the window count; open: those scheduled in it (their answers in it
    give the throughput); a request unanswered spec.grace_s after the window is late."""
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

    async def send(i: int) -> None:
        async with sem:
            conn = idle.pop() if idle else _Conn(spec)
            try:
                err = await conn.infer(spec.bodies[i % len(spec.bodies)])
            finally:
                idle.append(conn)
        if err:
            raise _Failed(err)

    def record(sent: float, done: float, kind: str, error: BaseException | None) -> None:
        if kind == "lost":
            res.late += 1
            return
        in_window = begin <= (sent if spec.mode == "open" else done) <= end
        if error is not None:
            res.errors += in_window
            res.first_error = res.first_error or str(error)
            return
        res.ok += begin <= done <= end
        if in_window:
            res.latencies_ms.append((done - sent) * 1000.0)

    async def lag_probe() -> None:  # a busy loop leaves answers unread: they are out of the server, not in it
        lags = []
        while (now := clock()) < end:
            await asyncio.sleep(0.01)
            if now >= begin:
                lags.append(max(0.0, clock() - now - 0.01) * 1000.0)
        res.loop_lag_ms = sum(lags) / len(lags) if lags else 0.0
        res.loop_lag_max_ms = max(lags, default=0.0)

    closed = spec.mode == "closed"
    probe = asyncio.create_task(lag_probe()) if closed else None
    load = Load(users=spec.concurrency) if closed else Load(rate=spec.rate, shape=spec.shape)
    await drive(send, load, clock, begin, end, record, seed=spec.seed, start=spec.t0, ramp_s=spec.ramp_s,
                grace_s=spec.grace_s)
    if probe is not None:
        await probe
    if closed and res.late:
        res.first_error = res.first_error or (f"{res.late} requests unanswered {spec.grace_s:g} s after the window "
                                              "(the server stopped answering)")
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

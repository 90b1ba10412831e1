"""The text endpoint's scheduler: one pool of tokenized texts per instance, fed by every Triton batch.

execute() tokenizes a batch and hands its texts here; dispatcher threads (max_in_flight of them) pick
encoder sub-batches from the whole pool and answer each request as soon as its last text is embedded
(the python backend's response sender, default mode, r24.06+). So a sub-batch is planned from every
text waiting, not from one Triton batch, and an instance is never held while its sub-batches run.

Policy (choose): the highest priority level present goes first; within it, the cheapest split of all
its texts into runs of similar lengths (fixed cost `split_overhead_tokens` + B x padded L per run) is
planned, and the run that holds the oldest text goes. The bigger the pool, the fuller and tighter the
runs (the bench's estimates: loadtest.targets).
While high-priority texts arrived within `query_window_s` (any instance: a shared marker), bulk runs are
capped at `query_token_budget` tokens and one in flight, so a query waits behind a short sub-batch.
Standard library and numpy only, like the rest of the text endpoint.
"""
from __future__ import annotations

import fcntl
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from text_core import EncoderBackend, EncoderOverloaded, TextError, TextSettings
from text_stages import plan_sub_batches

__all__ = ["Job", "Item", "choose", "QueryMarker", "QueuePolicy", "Scheduler"]


@dataclass(eq=False)
class Job:
    """One request: its rows' embeddings and token counts fill in as sub-batches return."""

    rows: int
    priority: int
    out: np.ndarray  # [rows, dim] float32
    tokens: np.ndarray  # [rows] int32
    remaining: int = 0
    error: TextError | None = None
    context: object = None  # the adapter's handle (the response sender)
    # where the time went (clock seconds): tokenize_us is set by the adapter; queued_at when its texts entered
    # the pool, started when its first sub-batch went to the encoder, ended when its last one returned
    tokenize_us: int = 0
    queued_at: float | None = None
    started: float | None = None
    ended: float | None = None

    def __post_init__(self) -> None:
        self.remaining = self.rows

    def timing_us(self) -> tuple[int, int, int]:
        """(tokenization, queue, inference) in microseconds: the batch's tokenization; the wait in the pool
        until its first sub-batch started; from then until its last sub-batch returned (0 where not reached)."""
        queued = self.started if self.started is not None else self.ended
        queue = queued - self.queued_at if queued is not None and self.queued_at is not None else 0.0
        infer = self.ended - self.started if self.ended is not None and self.started is not None else 0.0
        return self.tokenize_us, max(0, int(queue * 1e6)), max(0, int(infer * 1e6))


@dataclass(eq=False)
class Item:
    """One text waiting in the pool."""

    job: Job
    row: int
    ids: list[int]
    padded: int  # length rounded up to pad_to_multiple
    arrival: float


def choose(items: Sequence[Item], budget: int, max_batch: int, overhead: int) -> list[Item]:
    """The next sub-batch from one priority level's items (non-empty): the run that holds the oldest item
    in the cheapest split of them all (text_stages.plan_sub_batches: sorted by length, runs of at most
    max_batch texts and budget tokens, each paying `overhead` tokens). So every run is one the whole
    pool's best plan would make, and texts leave in arrival order of the runs that hold them.
    """
    plans = plan_sub_batches([it.padded for it in items], budget, max_batch, 1, overhead)
    oldest = min(range(len(items)), key=lambda k: items[k].arrival)
    rows = next(rows for rows, _ in plans if oldest in rows)
    return [items[k] for k in rows]


class QueryMarker:
    """What the instances of one model on one server share: when a query last arrived, and the bulk slot.

    A file of 8 bytes (CLOCK_MONOTONIC seconds, system-wide) under /dev/shm (else the temp dir), named by
    the model and the server process (the stubs' parent), so every instance's dispatchers see every query;
    in query mode a bulk sub-batch runs only while its instance holds the file's lock (one at a time).
    """

    def __init__(self, model: str, server_pid: int | None = None) -> None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in model)
        self.path = os.path.join(root, f"bge_triton_{safe}_{server_pid or os.getppid()}.query")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def try_bulk(self) -> bool:
        """Take the bulk slot if no other instance holds it (never blocks)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def release_bulk(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def mark(self, when: float) -> None:
        os.pwrite(self.fd, struct.pack("d", when), 0)

    def last(self) -> float:
        raw = os.pread(self.fd, 8, 0)
        return struct.unpack("d", raw)[0] if len(raw) == 8 else float("-inf")

    def close(self) -> None:
        """At unload (every instance unloads together): the file goes with the last one open."""
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # the other instance removed it first
            pass


@dataclass(frozen=True)
class QueuePolicy:
    """The text endpoint's own dynamic_batching.default_queue_policy, applied to its pool (Triton's queue
    stays empty: execute returns at once). 0 = no limit, as in Triton."""

    max_queue_size: int = 0  # requests with texts waiting
    timeout_s: float = 0.0  # a text waiting longer fails its request UNAVAILABLE

    @classmethod
    def from_config(cls, cfg: dict) -> "QueuePolicy":
        policy = cfg.get("dynamic_batching", {}).get("default_queue_policy", {})
        return cls(int(policy.get("max_queue_size", 0) or 0),
                   int(policy.get("default_timeout_microseconds", 0) or 0) / 1e6)


@dataclass
class Counters:
    """What the dispatchers did since the adapter last read them (Prometheus counters)."""

    real: int = 0
    padded: int = 0
    texts: int = 0
    subs: int = 0
    # Requests whose last text left the pool for the encoder, and the microseconds they waited there
    # (Triton's own queue time of the text endpoint stays near 0: execute returns at once).
    queued: int = 0
    queue_us: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self) -> dict[str, int]:
        with self.lock:
            out = {"real": self.real, "padded": self.padded, "texts": self.texts, "subs": self.subs,
                   "queued": self.queued, "queue_us": self.queue_us}
            self.real = self.padded = self.texts = self.subs = self.queued = self.queue_us = 0
        return out


class Scheduler:
    """The pool and its dispatcher threads; respond(job) is called once per job (error or embeddings)."""

    def __init__(self, settings: TextSettings, backend: EncoderBackend, pad_id: int, dim: int,
                 respond: Callable[[Job], None], marker: QueryMarker | None = None,
                 clock: Callable[[], float] = time.monotonic, policy: QueuePolicy = QueuePolicy()) -> None:
        self.s, self.backend, self.pad_id, self.dim, self.policy = settings, backend, pad_id, dim, policy
        self.respond, self.marker, self.clock = respond, marker, clock
        self.levels: dict[int, list[Item]] = {}
        self.pending = 0  # texts waiting
        self.waiting: dict[int, int] = {}  # id(job) -> its texts still waiting (the requests in the queue)
        self.running = 0  # sub-batches at the encoder
        self.bulk_running = 0
        self.last_query = float("-inf")
        self.counters = Counters()
        self.cond = threading.Condition()
        self.closing = False
        # max_in_flight dispatchers take any work; one more takes only queries, so a query never waits for
        # a dispatcher busy with bulk (only for the encoder)
        self.threads = [threading.Thread(target=self._dispatch, args=(i == settings.max_in_flight,),
                                         name=f"text-dispatch-{i}", daemon=True)
                        for i in range(settings.max_in_flight + (settings.query_levels > 0))]
        for t in self.threads:
            t.start()

    def new_job(self, rows: int, priority: int, context: object = None) -> Job:
        return Job(rows, priority, np.empty((rows, self.dim), np.float32), np.zeros(rows, np.int32),
                   context=context)

    def submit(self, jobs: Sequence[tuple[Job, Sequence[list[int]]]]) -> None:
        """Queue each job's token ids; past the queue policy's max_queue_size a job is answered UNAVAILABLE now."""
        now, rejected = self.clock(), []
        with self.cond:
            for job, ids in jobs:
                if not ids:  # nothing to embed (a request of zero texts): answered now, empty
                    rejected.append(job)
                    continue
                limit = self.policy.max_queue_size
                if self.closing or (limit and len(self.waiting) >= limit):
                    # Triton's own words for a full queue, so every client that knows Triton knows this
                    why = "text endpoint is unloading" if self.closing else (
                        f"Exceeds maximum queue size: the text endpoint has {len(self.waiting)} requests waiting "
                        f"(max_queue_size {limit})")
                    job.error = EncoderOverloaded(f"{why}; retry with backoff, or add text-endpoint instances / "
                                                  "encoder capacity")
                    rejected.append(job)
                    continue
                self.waiting[id(job)] = len(ids)
                self.levels.setdefault(job.priority, []).extend(self._items(job, ids, now))
                self.pending += len(ids)
                if 1 <= job.priority <= self.s.query_levels:
                    self.last_query = now
            if len(rejected) < len(jobs):
                self.cond.notify_all()
        if self.marker is not None and self.last_query == now:
            self.marker.mark(now)
        for job in rejected:  # refused, or empty
            self.respond(job)

    def _items(self, job: Job, ids: Sequence[list[int]], now: float) -> list[Item]:
        """The pool's entries of one job's texts (their token counts recorded for the answer)."""
        m = self.s.pad_to_multiple
        job.queued_at = now
        for row, tok in enumerate(ids):
            job.tokens[row] = len(tok)
        return [Item(job, row, tok, -(-len(tok) // m) * m, now) for row, tok in enumerate(ids)]

    def _query_mode(self, now: float) -> bool:
        last = max(self.last_query, self.marker.last() if self.marker is not None else float("-inf"))
        return now - last <= self.s.query_window_s

    def _expire(self, now: float) -> list[Job]:
        """Under the lock: drop the texts that waited past the queue timeout; their jobs fail UNAVAILABLE."""
        limit, failed = self.policy.timeout_s, {}
        if not limit:
            return []
        for level, items in self.levels.items():
            if items and now - min(it.arrival for it in items) > limit:
                for it in items:
                    if now - it.arrival > limit and it.job.error is None:
                        it.job.error = EncoderOverloaded(  # Triton's own words for a queue timeout
                            f"Request timeout expired: a text waited {now - it.arrival:.1f} s in the text "
                            f"endpoint's pool (queue timeout {limit:g} s); retry with backoff, or add encoder capacity")
                        failed[id(it.job)] = it.job
        if failed:
            for level, items in self.levels.items():
                kept = [it for it in items if id(it.job) not in failed]
                self.pending -= len(items) - len(kept)
                self.levels[level] = kept
            for key in failed:
                self.waiting.pop(key, None)
        return list(failed.values())

    def _take(self, queries_only: bool = False) -> tuple[list[Item], bool, bool] | None:
        """Under the lock: the next sub-batch, or None when nothing may run now."""
        live = sorted((p for p, items in self.levels.items() if items), key=lambda p: (p == 0, p))  # 0: no level
        if not live:
            return None
        now, s = self.clock(), self.s
        level = live[0]
        query = 1 <= level <= s.query_levels
        if queries_only and not query:
            return None
        budget = s.token_budget
        slot = False
        if not query and self._query_mode(now):
            if self.bulk_running >= 1 or (self.marker is not None and not self.marker.try_bulk()):
                return None
            budget, slot = min(budget, s.query_token_budget), self.marker is not None
        picked = choose(self.levels[level], budget, s.sub_batch_max, s.split_overhead_tokens)
        chosen = set(map(id, picked))
        self.levels[level] = [it for it in self.levels[level] if id(it) not in chosen]
        self.pending -= len(picked)
        left = []
        for it in picked:
            key = id(it.job)
            self.waiting[key] -= 1
            if not self.waiting[key]:
                del self.waiting[key]
                left.append(it)  # a job's texts all arrived together
        if left:
            with self.counters.lock:
                self.counters.queued += len(left)
                self.counters.queue_us += sum(int((now - it.arrival) * 1e6) for it in left)
        return picked, query, slot

    def _dispatch(self, queries_only: bool) -> None:
        while True:
            with self.cond:
                work, expired = None, []
                while not self.closing:
                    expired = self._expire(self.clock())
                    if expired:
                        break
                    work = self._take(queries_only)
                    if work is not None:
                        break
                    # nothing to run, or bulk held back in query mode: look again when woken or soon
                    self.cond.wait(0.005 if any(self.levels.values()) and not queries_only else None)
                if not expired and work is None:
                    return
                if work is not None:
                    picked, query, slot = work
                    self.running += 1
                    if not query:
                        self.bulk_running += 1
            if expired:  # a job whose other texts are still at the encoder is answered once, here
                for job in expired:
                    job.remaining = -1
                    self.respond(job)
                continue
            try:
                self._run(picked)
            finally:
                if slot:
                    self.marker.release_bulk()
                with self.cond:
                    self.running -= 1
                    if not query:
                        self.bulk_running -= 1
                    self.cond.notify_all()

    def run_inline(self, jobs: Sequence[tuple[Job, Sequence[list[int]]]]) -> bool:
        """Quiet hours: when nothing waits or runs and the jobs make one sub-batch, run it in the caller's
        thread (execute), skipping the hand-off to a dispatcher and the response sender; False = submit them.
        Not for bulk in query mode (it would not be capped)."""
        if not jobs or any(not ids for _, ids in jobs):
            return False
        s = self.s
        with self.cond:
            now = self.clock()
            queries = [1 <= job.priority <= s.query_levels for job, _ in jobs]
            if self.closing or self.running or self.pending or (not all(queries) and self._query_mode(now)):
                return False
            picked = [it for job, ids in jobs for it in self._items(job, ids, now)]
            if len(plan_sub_batches([it.padded for it in picked], s.token_budget, s.sub_batch_max, 1,
                                    s.split_overhead_tokens)) != 1:
                return False
            self.running += 1
            if any(queries):  # a query run here opens query mode as one submitted does
                self.last_query = now
        if any(queries) and self.marker is not None:
            self.marker.mark(now)
        with self.counters.lock:  # never waited in the pool
            self.counters.queued += len(jobs)
        try:
            self._run(picked, answer=False)
        finally:
            with self.cond:  # nothing waits on this (the pool did not change): no notify
                self.running -= 1
        return True

    def _run(self, picked: list[Item], answer: bool = True) -> None:
        pad_len = max(it.padded for it in picked)
        ids = np.full((len(picked), pad_len), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(picked), pad_len), dtype=np.int64)
        for k, it in enumerate(picked):
            ids[k, :len(it.ids)] = it.ids
            mask[k, :len(it.ids)] = 1
        error, out = None, None
        started = self.clock()
        try:
            with self.backend.hold():
                out = self.backend.run(ids, mask)
        except TextError as exc:
            error = exc.with_traceback(None)  # its frames hold the encoder's response: no cycle through this one
        except Exception as exc:  # noqa: BLE001 - a bug in a backend must answer its rows, not kill the thread
            error = TextError(f"encoder call failed: {type(exc).__name__}: {exc}")
        done = []
        with self.counters.lock:
            self.counters.subs += 1
            self.counters.padded += ids.size
            self.counters.real += int(mask.sum())
            self.counters.texts += len(picked) if error is None else 0
        ended = self.clock()
        with self.cond:
            for k, it in enumerate(picked):
                job = it.job
                job.started = started if job.started is None else min(job.started, started)
                job.ended = ended if job.ended is None else max(job.ended, ended)
                if error is not None:
                    job.error = job.error or error
                else:
                    job.out[it.row] = out[k]
                job.remaining -= 1
                if job.remaining == 0:
                    done.append(job)
        for job in done if answer else ():
            self.respond(job)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the dispatchers; texts still waiting are answered UNAVAILABLE (the model is unloading)."""
        with self.cond:
            self.closing = True
            left = {id(it.job): it.job for items in self.levels.values() for it in items}
            self.levels.clear()
            self.pending = 0
            self.waiting.clear()
            self.cond.notify_all()
        for job in left.values():
            job.error = EncoderOverloaded("text endpoint is unloading: retry on another replica")
            self.respond(job)
        for t in self.threads:
            t.join(timeout_s)
        if self.marker is not None:
            self.marker.close()

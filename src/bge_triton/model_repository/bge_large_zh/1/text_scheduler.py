"""The text endpoint's scheduler: one pool of tokenized texts per instance, fed by every Triton batch.

execute() tokenizes a batch and hands its texts here; dispatcher threads (max_in_flight of them) pick
encoder sub-batches from the whole pool and answer each request as soon as its last text is embedded
(the python backend's response sender, default mode, r24.06+). So a sub-batch is planned from every
text waiting, not from one Triton batch, and an instance is never held while its sub-batches run.

Policy (choose): the highest priority level present goes first; within it, the run that holds the oldest
text in the cheapest split (fixed cost `split_overhead_tokens` + B x padded L per run) of the texts of
similar length around it goes. Each level keeps its texts in FIFO buckets by padded length, so planning
looks at a window of at most 2 x sub_batch_max texts around the oldest, whatever the backlog
(`bge-triton bench plan-cost`); deadlines sit in a heap, so expiry costs only what expires.
While high-priority texts arrived within `query_window_s` (any instance: a shared marker), bulk runs are
capped at `query_token_budget` tokens and one in flight, so a query waits behind a short sub-batch.
Age bound (`age_bound_s`, 0 = off): a run is planned only from the texts that arrived within age_bound_s of
the oldest one waiting at its level, so a text is never overtaken by one that arrived more than age_bound_s
after it (shorter texts cannot starve a long one); texts that arrived together (a backlog sent at once) are
still grouped by length.

Every request is answered exactly once on every path (Job.done, set under the lock by whoever answers):
an encoder that raises or answers the wrong shape fails its sub-batch's requests; a request that fails
drops its texts still waiting; a respond() that raises is logged and the thread carries on. Admission
counts texts per priority level (Triton keeps one queue and limit per level); a reaper thread expires
deadlines (the config's timeout, or the request's own where allow_timeout_override) and asks the
adapter whether waiting requests were cancelled, a bounded number per round.
Standard library and numpy only, like the rest of the text endpoint.
"""
from __future__ import annotations

import collections
import fcntl
import heapq
import itertools
import math
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from text_core import Cancelled, EncoderBackend, EncoderFailed, EncoderOverloaded, TextError, TextSettings
from text_stages import plan_sub_batches

__all__ = ["Job", "Item", "Level", "choose", "QueryMarker", "QueuePolicy", "Scheduler", "CANCEL_CHECKS_PER_ROUND",
           "CANCEL_SHARE"]

CANCEL_CHECKS_PER_ROUND = 16  # is_cancelled() calls per reaper round (each a round trip to the server)
CANCEL_SHARE = 0.02  # at most this share of the reaper's wall time goes to is_cancelled() round trips


@dataclass(eq=False)
class Job:
    """One request: its rows' embeddings and token counts fill in as sub-batches return."""

    rows: int
    priority: int
    out: npt.NDArray[np.float32]  # [rows, dim]
    tokens: npt.NDArray[np.int32]  # [rows]
    remaining: int = 0  # texts not yet back from the encoder
    error: TextError | None = None
    context: object = None  # the adapter's handle (the response sender)
    # where the time went (clock seconds): tokenize_us is set by the adapter; queued_at when its texts entered
    # the pool, started when its first sub-batch went to the encoder, ended when its last one returned
    tokenize_us: int = 0
    queued_at: float | None = None
    started: float | None = None
    ended: float | None = None
    timeout_s: float = 0.0  # the request's own timeout (0 = the queue policy's)
    deadline: float = float("inf")
    key: int = -1  # its unique number in the pool (Scheduler.jobs, the deadline heap)
    waiting: int = 0  # texts still in the pool
    done: bool = False  # answered, or being answered, by exactly one thread
    items: list[Item] = field(default_factory=list, repr=False)
    # Held around the answer and around each is_cancelled() check: python_backend r24.10 asks the server about
    # the request's response factory, which the server deletes once the final response is sent (a check after
    # that would read freed memory in tritonserver), so a check runs only before the answer, never during it.
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
    """One text waiting in the pool (ids as int32: 4 bytes a token)."""

    job: Job
    row: int
    ids: npt.NDArray[np.int32] | Sequence[int]
    padded: int  # length rounded up to pad_to_multiple
    arrival: float
    dead: bool = False  # its request failed while it waited: skipped, never sent
    taken: bool = False  # left the pool for the encoder


class Pooled(Protocol):
    """What a level reads of a waiting text (Item; loadtest.targets.closed_loop_rate passes its own)."""

    padded: int
    arrival: float


class Level:
    """One priority level's waiting texts: a FIFO bucket per padded length, and live counts.

    Texts of a failed request are marked dead and skipped when they reach a bucket's head (lazy delete);
    a bucket with more dead than live entries is compacted. Arrivals are in clock order, so each bucket's
    head is its oldest text and the level's oldest is the oldest head."""

    def __init__(self) -> None:
        self.buckets: dict[int, collections.deque[Any]] = {}
        self.live: dict[int, int] = {}
        self.count = 0

    def add(self, item: Pooled) -> None:
        self.buckets.setdefault(item.padded, collections.deque()).append(item)
        self.live[item.padded] = self.live.get(item.padded, 0) + 1
        self.count += 1

    def drop(self, item: Item) -> None:
        """`item` leaves without running (its request failed)."""
        item.dead = True
        self.live[item.padded] -= 1
        self.count -= 1
        bucket = self.buckets[item.padded]
        if len(bucket) > 64 and len(bucket) > 2 * self.live[item.padded]:
            self.buckets[item.padded] = collections.deque(it for it in bucket if not it.dead)

    def _head(self, padded: int) -> Any:
        bucket = self.buckets[padded]
        while bucket and getattr(bucket[0], "dead", False):
            bucket.popleft()
        return bucket[0] if bucket else None

    def oldest(self) -> Any:
        heads = [self._head(p) for p, n in self.live.items() if n > 0]
        return min((h for h in heads if h is not None), key=lambda it: it.arrival, default=None)

    def eligible(self, padded: int, need: int, limit: float = math.inf) -> int:
        """How many live texts from the head of one bucket arrived by `limit` (at most `need`): the head's
        prefix, as a bucket is in arrival order. Reads at most `need` live entries past the dead."""
        if limit == math.inf:
            return min(need, self.live.get(padded, 0))
        n = 0
        for item in self.buckets[padded]:
            if n >= need or item.arrival > limit:
                break
            n += not getattr(item, "dead", False)
        return n

    def pop(self, padded: int, n: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            self._head(padded)  # past the dead
            item = self.buckets[padded].popleft()
            item.taken = True
            out.append(item)
        self.live[padded] -= n
        self.count -= n
        return out

    def pick(self, budget: int, max_batch: int, overhead: int, age_bound_s: float = 0.0) -> list[Any]:
        """The next run (see the module doc): the oldest text and its neighbours by length, from the texts that
        arrived within age_bound_s of the oldest (0: all); [] if empty."""
        head = self.oldest()
        if head is None:
            return []
        limit = head.arrival + age_bound_s if age_bound_s > 0 else math.inf
        p0 = head.padded
        cap = max(1, min(max_batch, budget // p0))
        if self.eligible(p0, cap, limit) >= cap:  # a full run of equal lengths: no padding, the fixed cost shared
            return self.pop(p0, cap)
        keys = sorted(p for p, n in self.live.items() if n > 0)
        at = keys.index(p0)
        below: list[int] = []
        for p in reversed(keys[:at]):  # up to max_batch shorter texts, nearest lengths first
            below[:0] = [p] * self.eligible(p, max_batch - len(below), limit)
            if len(below) >= max_batch:
                break
        above: list[int] = []
        for p in keys[at:]:  # the oldest's bucket first (its head is at index len(below)), then longer ones
            above += [p] * self.eligible(p, max_batch - len(above), limit)
            if len(above) >= max_batch:
                break
        pads = below + above
        rows = next(rows for rows, _ in plan_sub_batches(pads, budget, max_batch, 1, overhead) if len(below) in rows)
        wanted = collections.Counter(pads[k] for k in rows)
        return [it for p, n in sorted(wanted.items()) for it in self.pop(p, n)]


def choose(items: Sequence[Any], budget: int, max_batch: int, overhead: int, age_bound_s: float = 0.0) -> list[Any]:
    """The scheduler's policy on a plain list of texts (anything with .padded and .arrival): the run the
    scheduler would send next from a level holding them (Level.pick). For estimates
    (loadtest.targets.closed_loop_rate)."""
    level = Level()
    for it in sorted(items, key=lambda it: it.arrival):
        level.add(it)
    return level.pick(budget, max_batch, overhead, age_bound_s)


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
    """The text endpoint's dynamic_batching queue policy, applied to its pool (Triton's queue stays empty:
    execute returns at once), one per priority level as Triton keeps them. 0 = no limit, as in Triton.
    max_queue_size counts TEXTS waiting at a level in one instance (Triton's counts requests)."""

    max_queue_size: int = 0  # texts waiting at one priority level
    timeout_s: float = 0.0  # a text waiting longer fails its request UNAVAILABLE
    allow_timeout_override: bool = False  # a request's own timeout replaces timeout_s
    levels: tuple[tuple[int, int, float], ...] = ()  # priority_queue_policy: (level, max_queue_size, timeout_s)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> QueuePolicy:
        batching = cfg.get("dynamic_batching", {})
        policy = batching.get("default_queue_policy", {})
        levels = tuple(sorted((int(level), int(p.get("max_queue_size", 0) or 0),
                               int(p.get("default_timeout_microseconds", 0) or 0) / 1e6)
                              for level, p in (batching.get("priority_queue_policy") or {}).items()))
        return cls(int(policy.get("max_queue_size", 0) or 0),
                   int(policy.get("default_timeout_microseconds", 0) or 0) / 1e6,
                   bool(policy.get("allow_timeout_override", False)), levels)

    def of(self, level: int) -> tuple[int, float]:
        """(max_queue_size, timeout_s) of one priority level."""
        for lv, size, timeout in self.levels:
            if lv == level:
                return size, timeout
        return self.max_queue_size, self.timeout_s


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
    """The pool and its threads; respond(job) is called exactly once per job (error or embeddings).

    `cancelled(job)` (optional) says whether the job's client cancelled it (the adapter asks Triton);
    `log(message)` reports what a thread caught and carried on from."""

    def __init__(self, settings: TextSettings, backend: EncoderBackend, pad_id: int, dim: int,
                 respond: Callable[[Job], None], marker: QueryMarker | None = None,
                 clock: Callable[[], float] = time.monotonic, policy: QueuePolicy = QueuePolicy(),
                 cancelled: Callable[[Job], bool] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.s, self.backend, self.pad_id, self.dim, self.policy = settings, backend, pad_id, dim, policy
        self.respond, self.marker, self.clock = respond, marker, clock
        self.cancelled, self.log = cancelled, log or (lambda message: None)
        self.age_bound_s = settings.age_bound_s  # text_core.TextSettings: 0 = off
        self.levels: dict[int, Level] = {}
        self.pending = 0  # texts waiting
        self.jobs: collections.OrderedDict[int, Job] = collections.OrderedDict()  # with texts waiting, by seq
        # (deadline, job key): keys, not jobs, so an answered job is freed at once, not when its deadline passes
        self.deadlines: list[tuple[float, int]] = []  # heap
        self.seq = itertools.count()
        self.running = 0  # sub-batches at the encoder
        self.bulk_running = 0
        self.last_query = float("-inf")
        self.counters = Counters()
        self.cancel_checks, self.cancel_check_s_total = 0, 0.0  # is_cancelled() calls and their seconds
        self.cond = threading.Condition()
        self.closing = False
        self.stop = threading.Event()
        # max_in_flight dispatchers take any work; one more takes only queries, so a query never waits for
        # a dispatcher busy with bulk (only for the encoder)
        self.threads = [threading.Thread(target=self._dispatch, args=(i == settings.max_in_flight,),
                                         name=f"text-dispatch-{i}", daemon=True)
                        for i in range(settings.max_in_flight + (settings.query_levels > 0))]
        self.threads.append(threading.Thread(target=self._reap, name="text-reaper", daemon=True))
        for t in self.threads:
            t.start()

    @property
    def waiting(self) -> dict[int, Job]:
        """The requests with texts waiting (by arrival)."""
        return self.jobs

    def new_job(self, rows: int, priority: int, context: object = None, timeout_s: float = 0.0) -> Job:
        return Job(rows, priority, np.empty((rows, self.dim), np.float32), np.zeros(rows, np.int32),
                   context=context, timeout_s=timeout_s)

    # --- answering, exactly once --------------------------------------------------------------------------

    def _finish(self, job: Job, error: TextError | None = None) -> bool:
        """Under the lock: mark `job` answered (with `error`), drop its texts still waiting; False if it was
        answered already (the caller then must not answer it)."""
        if job.done:
            return False
        job.done = True
        if error is not None:
            job.error = job.error or error
        if job.waiting:
            level = self.levels[job.priority]
            for it in job.items:
                if not it.dead and not it.taken:
                    level.drop(it)
                    self.pending -= 1
            job.waiting = 0
        self.jobs.pop(job.key, None)
        job.items = []
        return True

    def claim(self, job: Job) -> bool:
        """Take over answering `job` (the adapter, after a fault of its own): True if nobody answered it yet; its
        texts still waiting are dropped and nothing here will answer it (answer it holding job.guard)."""
        with self.cond:
            return self._finish(job, EncoderFailed("text endpoint failed on this request's batch"))

    def _answer(self, jobs: Sequence[Job]) -> None:
        """Outside the lock: respond() for each (already _finish-ed) job; a respond that raises is logged."""
        for job in jobs:
            try:
                with job.guard:
                    self.respond(job)
            except Exception as exc:
                self.log(f"text endpoint: answering a request raised {type(exc).__name__}: {exc}")

    # --- admission ------------------------------------------------------------------------------------------

    def submit(self, jobs: Sequence[tuple[Job, Sequence[Sequence[int]]]]) -> None:
        """Queue each job's token ids; past its level's max_queue_size (texts) a job is answered UNAVAILABLE now."""
        now, refused = self.clock(), []
        with self.cond:
            for job, ids in jobs:
                limit, timeout = self.policy.of(job.priority)
                level = self.levels.setdefault(job.priority, Level())
                why = None
                if self.closing:
                    why = "text endpoint is unloading; retry on another replica"
                elif limit and level.count + len(ids) > limit:
                    # Triton's own words for a full queue, so every client that knows Triton knows this
                    why = (f"Exceeds maximum queue size: {level.count} texts wait at priority level {job.priority} in "
                           f"this text-endpoint instance (max_queue_size {limit} texts per level), this request has "
                           f"{len(ids)}; retry with backoff, or add text-endpoint instances / encoder capacity")
                if not ids or why is not None:  # refused, or nothing to embed (answered now, empty)
                    self._finish(job, EncoderOverloaded(why) if why else None)
                    refused.append(job)
                    continue
                if self.policy.allow_timeout_override and job.timeout_s > 0:
                    timeout = job.timeout_s
                job.items = self._items(job, ids, now)
                for it in job.items:
                    level.add(it)
                job.waiting = len(ids)
                self.pending += len(ids)
                job.key = next(self.seq)
                self.jobs[job.key] = job
                if timeout:
                    job.deadline = now + timeout
                    heapq.heappush(self.deadlines, (job.deadline, job.key))
                if 1 <= job.priority <= self.s.query_levels:
                    self.last_query = now
            if len(refused) < len(jobs):
                self.cond.notify_all()
        if self.marker is not None and self.last_query == now:
            self.marker.mark(now)
        self._answer(refused)

    def _items(self, job: Job, ids: Sequence[Sequence[int]], now: float) -> list[Item]:
        """The pool's entries of one job's texts (their token counts recorded for the answer)."""
        m = self.s.pad_to_multiple
        job.queued_at = now
        for row, tok in enumerate(ids):
            job.tokens[row] = len(tok)
        return [Item(job, row, np.asarray(tok, np.int32), -(-len(tok) // m) * m, now)
                for row, tok in enumerate(ids)]

    # --- deadlines and cancellation ------------------------------------------------------------------------

    def _expire(self, now: float) -> list[Job]:
        """Under the lock: requests with texts still waiting at their deadline fail UNAVAILABLE."""
        failed = []
        while self.deadlines and self.deadlines[0][0] <= now:
            _, key = heapq.heappop(self.deadlines)
            job = self.jobs.get(key)
            if job is None or job.done or not job.waiting:  # answered, or every text left: not a queue timeout
                continue
            waited = now - (job.queued_at if job.queued_at is not None else now)
            limit = job.deadline - (job.queued_at or 0.0)
            if self._finish(job, EncoderOverloaded(  # Triton's own words for a queue timeout
                    f"Request timeout expired: a text waited {waited:.1f} s in the text endpoint's pool (queue "
                    f"timeout {limit:g} s); retry with backoff, or add encoder capacity")):
                failed.append(job)
        return failed

    def _reap(self) -> None:
        """Expire deadlines even while every dispatcher is at the encoder; drop cancelled requests' texts.

        Each is_cancelled() is a round trip to the server that holds the GIL (r24.10's binding does not release
        it) and costs more the busier the host: the checks take at most CANCEL_SHARE of the reaper's wall time
        (after a round that took t, the next waits t / CANCEL_SHARE), so under load they thin out, never the
        dispatchers' time."""
        interval = self.s.cancel_check_s or 0.05
        next_check = 0.0
        while not self.stop.wait(interval):
            try:
                with self.cond:
                    expired = self._expire(self.clock())
                    check = self.cancelled if self.s.cancel_check_s else None
                    due = check is not None and time.perf_counter() >= next_check
                    batch = self._rotate(CANCEL_CHECKS_PER_ROUND) if due else []
                self._answer(expired)
                gone = []
                started = time.perf_counter()
                for job in batch:  # outside the pool lock: each check is a round trip to the server
                    try:
                        with job.guard:  # never once its answer went (see Job.guard)
                            if not job.done and check is not None and check(job):
                                gone.append(job)
                    except Exception as exc:
                        self.log(f"text endpoint: is_cancelled raised {type(exc).__name__}: {exc}")
                if batch:
                    spent = time.perf_counter() - started
                    self.cancel_checks += len(batch)
                    self.cancel_check_s_total += spent
                    next_check = started + spent / CANCEL_SHARE
                if gone:
                    with self.cond:
                        gone = [j for j in gone if self._finish(j, Cancelled(
                            "the request was cancelled by its client: its texts still waiting were dropped"))]
                    self._answer(gone)
            except Exception as exc:
                self.log(f"text endpoint: reaper caught {type(exc).__name__}: {exc}")

    def _rotate(self, n: int) -> list[Job]:
        """Under the lock: the next n waiting jobs, round robin (so each gets checked, n per round)."""
        out = []
        for _ in range(min(n, len(self.jobs))):
            key, job = self.jobs.popitem(last=False)
            self.jobs[key] = job
            out.append(job)
        return out

    # --- dispatch -------------------------------------------------------------------------------------------

    def _query_mode(self, now: float) -> bool:
        last = max(self.last_query, self.marker.last() if self.marker is not None else float("-inf"))
        return now - last <= self.s.query_window_s

    def _take(self, queries_only: bool = False) -> tuple[list[Item], bool, bool] | None:
        """Under the lock: the next sub-batch, or None when nothing may run now."""
        live = sorted((p for p, level in self.levels.items() if level.count), key=lambda p: (p == 0, p))  # 0: none
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
        picked = self.levels[level].pick(budget, s.sub_batch_max, s.split_overhead_tokens, self.age_bound_s)
        self.pending -= len(picked)
        left = []
        for it in picked:
            job = it.job
            job.waiting -= 1
            if not job.waiting:
                self.jobs.pop(job.key, None)
                left.append(job)  # a job's texts all arrived together
        if left:
            with self.counters.lock:
                self.counters.queued += len(left)
                self.counters.queue_us += sum(int((now - job.queued_at) * 1e6) for job in left)
        return picked, query, slot

    def _next(self, queries_only: bool) -> tuple[tuple[list[Item], bool, bool] | None, list[Job]]:
        """Under the lock: (work, expired) once there is something to do; (None, []) when closing."""
        while not self.closing:
            expired = self._expire(self.clock())
            if expired:
                return None, expired
            work = self._take(queries_only)
            if work is not None:
                return work, []
            # nothing to run, or bulk held back in query mode: look again when woken or soon. Deadlines are the
            # reaper's (every cancel_check_s): waking here at each one would wake an idle dispatcher for every
            # request at peak (one deadline per request)
            self.cond.wait(0.005 if self.pending and not queries_only else None)
        return None, []

    def _dispatch(self, queries_only: bool) -> None:
        while True:
            picked: list[Item] = []
            slot, query, counted = False, True, False
            try:
                with self.cond:
                    work, expired = self._next(queries_only)
                    if work is None and not expired:
                        return
                    if work is not None:
                        picked, query, slot = work
                        self.running += 1
                        counted = True
                        if not query:
                            self.bulk_running += 1
                if expired:  # a job whose other texts are still at the encoder is answered once, here
                    self._answer(expired)
                    continue
                self._run(picked)
            except Exception as exc:
                self.log(f"text endpoint: dispatcher caught {type(exc).__name__}: {exc}")
                self._fail(picked, EncoderFailed(f"text endpoint failed on a sub-batch: {type(exc).__name__}: {exc}"))
                self.stop.wait(0.01)  # no busy loop if the fault repeats
            finally:
                if counted:
                    if slot and self.marker is not None:
                        self.marker.release_bulk()
                    with self.cond:
                        self.running -= 1
                        if not query:
                            self.bulk_running -= 1
                        self.cond.notify_all()

    def _fail(self, picked: Sequence[Item], error: TextError) -> None:
        with self.cond:
            failed = [job for job in {id(it.job): it.job for it in picked}.values() if self._finish(job, error)]
        self._answer(failed)

    def run_inline(self, jobs: Sequence[tuple[Job, Sequence[Sequence[int]]]]) -> bool:
        """Quiet hours: when nothing waits or runs and the jobs make one sub-batch, run it in the caller's
        thread (execute), skipping the hand-off to a dispatcher and the response sender; False = submit them.
        Not for bulk in query mode (it would not be capped). True: every job is done (error or embeddings)."""
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
        try:
            if any(queries) and self.marker is not None:
                self.marker.mark(now)
            with self.counters.lock:  # never waited in the pool
                self.counters.queued += len(jobs)
            self._run(picked, answer=False)
        except Exception as exc:
            with self.cond:
                for job, _ in jobs:
                    self._finish(job, EncoderFailed(f"text endpoint failed on a sub-batch: {type(exc).__name__}: "
                                                    f"{exc}"))
        finally:
            with self.cond:  # nothing waits on this (the pool did not change): no notify
                self.running -= 1
        return True

    def _check(self, out: Any, rows: int) -> tuple[npt.NDArray[np.float32] | None, TextError | None]:
        """The encoder's answer as float32 [rows, dim], or the error naming what came back instead."""
        try:
            arr = np.asarray(out, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            return None, EncoderFailed(f"encoder {self.s.onnx_model} answered something that is not an array of "
                                       f"floats ({type(out).__name__}: {exc})")
        if arr.shape != (rows, self.dim):
            return None, EncoderFailed(f"encoder {self.s.onnx_model} answered shape {list(arr.shape)} for a "
                                       f"sub-batch of {rows} texts: expected [{rows}, {self.dim}]; check its "
                                       "config's output dims against this model's")
        return arr, None

    def _run(self, picked: list[Item], answer: bool = True) -> None:
        """One sub-batch: pad, run, fill each job's rows; a job is answered when its last row is in, or at once
        when its sub-batch fails (its texts still waiting are dropped, never sent)."""
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
        except Exception as exc:
            error = EncoderFailed(f"encoder call failed: {type(exc).__name__}: {exc}")
        ended = self.clock()
        arr = None
        if error is None:
            arr, error = self._check(out, len(picked))
        with self.counters.lock:
            self.counters.subs += 1
            self.counters.padded += ids.size
            self.counters.real += int(mask.sum())
            self.counters.texts += len(picked) if error is None else 0
        done = []
        with self.cond:
            for k, it in enumerate(picked):
                job = it.job
                if job.done:  # failed meanwhile (another sub-batch, its deadline, cancelled): answered already
                    continue
                job.started = started if job.started is None else min(job.started, started)
                job.ended = ended if job.ended is None else max(job.ended, ended)
                if error is not None:
                    if self._finish(job, error):
                        done.append(job)
                    continue
                assert arr is not None  # checked above: no error means an answer of the right shape
                job.out[it.row] = arr[k]
                job.remaining -= 1
                if job.remaining == 0 and self._finish(job):
                    done.append(job)
        if answer:
            self._answer(done)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads (waiting at most timeout_s for all of them); texts still waiting are answered
        UNAVAILABLE (the model is unloading)."""
        with self.cond:
            self.closing = True
            left = [job for job in list(self.jobs.values())
                    if self._finish(job, EncoderOverloaded("text endpoint is unloading: retry on another replica"))]
            self.cond.notify_all()
        self.stop.set()
        self._answer(left)
        end = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [t.name for t in self.threads if t.is_alive()]
        if stuck:  # e.g. still in an encoder call for requests answered already (deadline, cancel): logged
            self.log(f"text endpoint: {', '.join(stuck)} still running {timeout_s:g} s after the unload began")
        with self.cond:  # every job goes now (the dead texts left in the buckets hold theirs), with its sender: the
            # adapter's pb_utils objects must be freed while the stub runs (model.py, finalize)
            self.levels.clear()
            self.jobs.clear()
            self.deadlines.clear()
            self.pending = 0
        if self.marker is not None:
            self.marker.close()


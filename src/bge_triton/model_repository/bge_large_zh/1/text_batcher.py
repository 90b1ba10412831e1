"""The text endpoint's "triton" scheduler mode: Triton's dynamic batcher holds the waiting texts; execute runs a batch.

Parameter `scheduler` "triton" (text_core.TextSettings). Triton's queue keeps the requests (per priority level, with
its queue policy, request timeouts and cancellation); each execute() gets one Triton batch, and this module:
1. plans it once (text_stages.plan_sub_batches, queries and bulk apart, queries first): length-sorted token-budget
   sub-batches;
2. sends them to the encoder concurrently, at most `max_in_flight` at once from this instance (python_backend r24.10
   runs a coroutine returned by execute to completion in default mode, src/pb_stub.cc, and BLS async_exec runs each
   call in the event loop's thread pool);
3. returns one result per request, in order: embeddings, or that request's own TextError. A request that failed or
   whose client cancelled it (asked before its sub-batches once it sent texts or waited cancel_check_s, if > 0)
   sends none of its texts still to go; the rest of the batch is untouched.
Query mode (a request at a level <= query_levels in the batch, or seen within query_window_s by any instance: the
QueryMarker of text_scheduler): bulk sub-batches still to start are cut to query_token_budget tokens and run one at
a time across the instances (the marker's bulk slot), so a query at the encoder waits behind one short bulk
sub-batch at most. Planning and assembly are pure (plan, chunk, pad, accept: no Triton); Batcher.run is the async
part, given the encoder call as a coroutine function.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from text_core import Cancelled, EncoderFailed, TextError, TextSettings
from text_scheduler import CANCEL_SHARE, Counters, QueryMarker
from text_stages import Batch, plan_sub_batches

__all__ = ["Result", "SubBatch", "plan", "chunk", "pad", "accept", "is_query", "SharedMarker", "Batcher",
           "SLOT_POLL_S"]

SLOT_POLL_S = 0.001  # how often a bulk sub-batch in query mode asks for the instances' shared bulk slot

RunEncoder = Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64]], Awaitable[Any]]
RunBlocking = Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64]], Any]


@dataclass(eq=False)
class Result:
    """One request of the batch: its rows fill in as sub-batches return (what model.py's _response reads)."""

    rows: int
    priority: int
    out: npt.NDArray[np.float32]  # [rows, dim]
    tokens: npt.NDArray[np.int32]  # [rows]
    remaining: int = 0  # rows not yet embedded
    error: TextError | None = None
    cancelled: Callable[[], bool] | None = None  # asks Triton whether the client cancelled the request
    tokenize_us: int = 0
    queued_at: float | None = None  # planned (clock seconds)
    started: float | None = None  # its first sub-batch went to the encoder
    ended: float | None = None  # its last sub-batch returned
    launched: bool = False  # a sub-batch of it went to the encoder already

    def __post_init__(self) -> None:
        self.remaining = self.rows

    @property
    def done(self) -> bool:
        return self.error is not None or self.remaining == 0

    def fail(self, error: TextError) -> None:
        """The request's own error (the first one wins); its rows still to go are dropped."""
        if self.error is None:
            self.error = error

    def timing_us(self) -> tuple[int, int, int]:
        """(tokenization of the batch, wait in this execute until its first sub-batch started, inference)."""
        first = self.started if self.started is not None else self.ended
        queue = first - self.queued_at if first is not None and self.queued_at is not None else 0.0
        infer = self.ended - self.started if self.ended is not None and self.started is not None else 0.0
        return self.tokenize_us, max(0, int(queue * 1e6)), max(0, int(infer * 1e6))


@dataclass
class SubBatch:
    """One planned encoder call: rows as (result index, row in that request, token ids), shortest first."""

    rows: list[tuple[int, int, Sequence[int]]]
    query: bool = False
    # (result index, row) of the rows actually sent (set by pad: a failed or cancelled request's rows are left out)
    sent: list[tuple[int, int]] = field(default_factory=list)


def is_query(level: int, settings: TextSettings) -> bool:
    """Levels 1..query_levels are queries (0 = none sent, never a query)."""
    return 1 <= level <= settings.query_levels


def plan(batch: Batch, results: Sequence[Result | None], settings: TextSettings) -> list[SubBatch]:
    """The batch's sub-batches, planned once: queries and bulk apart (a query never waits for bulk padding), each
    by text_stages.plan_sub_batches; queries first. `results[r]` is request r's Result (None: answered already)."""
    s = settings
    groups: dict[bool, list[tuple[int, int, Sequence[int]]]] = {True: [], False: []}
    for r, start, n in batch.slots:
        res = results[r]
        if res is None:
            continue
        for row in range(n):
            groups[is_query(res.priority, s)].append((r, row, batch.ids[start + row]))
    subs: list[SubBatch] = []
    for query in (True, False):
        rows = groups[query]
        if not rows:
            continue
        for picked, _pad_len in plan_sub_batches([len(ids) for _, _, ids in rows], s.token_budget, s.sub_batch_max,
                                                 s.pad_to_multiple, s.split_overhead_tokens):
            subs.append(SubBatch([rows[k] for k in picked], query))
    return subs


def chunk(sub: SubBatch, budget: int, multiple: int) -> list[SubBatch]:
    """`sub` cut into runs of its rows (shortest first, as planned) of at most `budget` padded tokens each (a lone
    longer text still gets its own run): query mode's short bulk sub-batches."""
    out: list[SubBatch] = []
    run: list[tuple[int, int, Sequence[int]]] = []
    for row in sorted(sub.rows, key=lambda row: len(row[2])):
        padded = -(-len(row[2]) // multiple) * multiple
        if run and (len(run) + 1) * padded > budget:
            out.append(SubBatch(run, sub.query))
            run = []
        run.append(row)
    if run:
        out.append(SubBatch(run, sub.query))
    return out


def pad(sub: SubBatch, results: Sequence[Result], pad_id: int, multiple: int
        ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """(input_ids, attention_mask) of the rows whose request is still going (sub.sent says which), padded to the
    longest rounded up to `multiple`; None when no row is left."""
    rows = [(r, row, ids) for r, row, ids in sub.rows if not results[r].done]
    sub.sent = [(r, row) for r, row, _ in rows]
    if not rows:
        return None
    length = -(-max(len(ids) for _, _, ids in rows) // multiple) * multiple
    ids_arr = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for k, (_, _, ids) in enumerate(rows):
        ids_arr[k, :len(ids)] = ids
        mask[k, :len(ids)] = 1
    return ids_arr, mask


def check(out: Any, rows: int, dim: int, model: str) -> tuple[npt.NDArray[np.float32] | None, TextError | None]:
    """The encoder's answer as float32 [rows, dim], or the error naming what came back instead."""
    try:
        arr = np.asarray(out, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        return None, EncoderFailed(f"encoder {model} answered something that is not an array of floats "
                                   f"({type(out).__name__}: {exc})")
    if arr.shape != (rows, dim):
        return None, EncoderFailed(f"encoder {model} answered shape {list(arr.shape)} for a sub-batch of {rows} "
                                   f"texts: expected [{rows}, {dim}]; check its config's output dims against this "
                                   "model's")
    return arr, None


def accept(sub: SubBatch, results: Sequence[Result], arr: npt.NDArray[np.float32] | None, error: TextError | None,
           started: float, ended: float) -> None:
    """One sub-batch's answer into its requests' rows; an error fails each request it held (their other rows are
    then dropped)."""
    for k, (r, row) in enumerate(sub.sent):
        res = results[r]
        res.started = started if res.started is None else min(res.started, started)
        res.ended = ended if res.ended is None else max(res.ended, ended)
        if res.done:
            continue
        if error is not None or arr is None:
            res.fail(error or EncoderFailed("encoder answered nothing"))
            continue
        res.out[row] = arr[k]
        res.remaining -= 1


class SharedMarker(QueryMarker):
    """text_scheduler's QueryMarker, named by the ENCODER and shared by every text model in front of it (a bulk
    model and its query-only model). Each opener holds a shared lock on a companion file (`.users`: a lock on the
    marker itself would take its bulk slot); the last to close (its exclusive lock granted) removes both, so a model
    unloaded while another stays leaves the marker to it and to models loaded later."""

    def __init__(self, encoder: str, server_pid: int | None = None) -> None:
        super().__init__(encoder, server_pid)
        self.users_path = self.path + ".users"
        self.users = os.open(self.users_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.users, fcntl.LOCK_SH)

    def close(self) -> None:
        try:
            fcntl.flock(self.users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted: no other model holds the marker
            last = True
        except BlockingIOError:
            last = False
        if last:
            for path in (self.path, self.users_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        os.close(self.users)
        os.close(self.fd)


class Batcher:
    """One instance's executor of Triton batches (see the module doc). `run(ids, mask)` is the encoder call (a
    coroutine function: BLS async_exec, or a blocking backend in the loop's thread pool); raising TextError (or
    anything) fails the sub-batch's requests only. `run_blocking` (optional) is the same call blocking, for a batch
    of one sub-batch (inline)."""

    def __init__(self, settings: TextSettings, pad_id: int, dim: int, run: RunEncoder,
                 marker: QueryMarker | None = None, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None, run_blocking: RunBlocking | None = None) -> None:
        self.s, self.pad_id, self.dim, self.encode, self.run_blocking = settings, pad_id, dim, run, run_blocking
        self.marker, self.clock = marker, clock
        self.log = log or (lambda message: None)
        self.counters = Counters()
        self.last_query = float("-inf")
        self.cancel_checks = 0  # is_cancelled() calls (each a round trip to the server)
        self.ask_s = 0.0  # their seconds in the batch being run

    def new_result(self, rows: int, priority: int) -> Result:
        return Result(rows, priority, np.zeros((rows, self.dim), np.float32), np.zeros(rows, np.int32))

    def query_mode(self, now: float) -> bool:
        last = max(self.last_query, self.marker.last() if self.marker is not None else float("-inf"))
        return now - last <= self.s.query_window_s

    def prepare(self, batch: Batch, results: Sequence[Result | None]) -> tuple[list[Result], list[SubBatch]]:
        """Before any encoder call: each live result's token counts and start time, query mode marked when the batch
        holds a query, and the batch's plan. Returns (results with None replaced by an answered stand-in, plan)."""
        full = [res if res is not None else _ANSWERED for res in results]
        now = self.clock()
        for r, start, n in batch.slots:
            res = full[r]
            res.tokens[:] = [len(ids) for ids in batch.ids[start:start + n]]
            res.tokenize_us, res.queued_at = batch.tokenize_us, now
        if any(is_query(res.priority, self.s) for res in results if res is not None):
            self.last_query = now
            if self.marker is not None:
                self.marker.mark(now)
        return full, plan(batch, results, self.s)

    def inline(self, subs: Sequence[SubBatch], results: Sequence[Result]) -> bool:
        """Quiet hours: a batch that is one sub-batch (and not bulk in query mode) runs here, with the blocking
        encoder call, skipping the event loop and its thread pool; False = use run_planned. True: every row done."""
        if self.run_blocking is None or len(subs) != 1 or (not subs[0].query and self.query_mode(self.clock())):
            return False
        blocking = self.run_blocking
        try:
            started, arrays = self._start(subs[0], results)
            if arrays is not None:
                out, error = self._call(lambda: blocking(*arrays))
                self._finish(subs[0], results, arrays, out, error, started)
        except Exception as exc:
            self._crashed(subs[0], results, exc)
        return True

    async def run(self, batch: Batch, results: Sequence[Result | None]) -> None:
        """prepare + run_planned (the whole batch through the event loop)."""
        full, subs = self.prepare(batch, results)
        await self.run_planned(subs, full)

    async def run_planned(self, subs: Sequence[SubBatch], full: Sequence[Result]) -> None:
        """Embed every row of the planned sub-batches, at most max_in_flight at the encoder at once. Never raises
        for one request's fault: each ends with embeddings or its own error."""
        live = [res for res in full if res is not _ANSWERED]
        self.ask_s = 0.0
        in_flight = asyncio.Semaphore(max(1, self.s.max_in_flight))
        bulk = asyncio.Lock()  # query mode: one bulk sub-batch at a time from this instance
        tasks: list[asyncio.Future[None]] = []
        try:
            for sub in subs:
                query_mode = not sub.query and self.query_mode(self.clock())
                parts = chunk(sub, min(self.s.token_budget, self.s.query_token_budget), self.s.pad_to_multiple) \
                    if query_mode else [sub]
                for part in parts:
                    await in_flight.acquire()
                    held: asyncio.Lock | None = None
                    slot = False
                    try:
                        if query_mode:
                            await bulk.acquire()
                            held = bulk
                            slot = await self._bulk_slot()
                        self._drop_cancelled(part, full)
                    except BaseException:
                        self._release(in_flight, held, slot)
                        raise
                    tasks.append(asyncio.ensure_future(self._one(part, full, in_flight, held, slot)))
        except Exception as exc:  # a bug here: the requests still going fail INTERNAL, the rest stays as it is
            self.log(f"text endpoint: planning a batch raised {type(exc).__name__}: {exc}")
            for res in live:
                if not res.done:
                    res.fail(EncoderFailed(f"text endpoint failed on this batch: {type(exc).__name__}: {exc}"))
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for res in live:  # every row was sent and answered, or the request failed; nothing is left half done
            if not res.done:
                res.fail(EncoderFailed("text endpoint lost rows of this request (a bug): retry"))

    async def _bulk_slot(self) -> bool:
        """Wait for the instances' shared bulk slot (the marker's lock); True when taken (released after the run)."""
        if self.marker is None:
            return False
        while not self.marker.try_bulk():
            await asyncio.sleep(SLOT_POLL_S)
        return True

    def _release(self, in_flight: asyncio.Semaphore, held: asyncio.Lock | None, slot: bool) -> None:
        if slot and self.marker is not None:
            self.marker.release_bulk()
        if held is not None:
            held.release()
        in_flight.release()

    def _drop_cancelled(self, sub: SubBatch, results: Sequence[Result]) -> None:
        """Before a sub-batch starts, ask whether its requests' clients cancelled them (r24.10: each ask a round trip
        to the server). A request that sent texts already is always asked; one that has not is asked once it has
        waited cancel_check_s in this execute (Triton dropped it from its queue if it was cancelled there), while the
        asks took at most CANCEL_SHARE of that wait. Cancelled: failed CANCELLED, none of its texts still to go is
        sent."""
        if not self.s.cancel_check_s:
            return
        now = self.clock()
        seen: set[int] = set()
        for r, _, _ in sub.rows:
            res = results[r]
            if r in seen or res.done or res.cancelled is None:
                continue
            seen.add(r)
            if not res.launched:
                waited = now - (res.queued_at if res.queued_at is not None else now)
                if waited < self.s.cancel_check_s or self.ask_s > CANCEL_SHARE * waited:
                    continue
            self.cancel_checks += 1
            started = time.perf_counter()
            try:
                gone = res.cancelled()
            except Exception as exc:
                self.log(f"text endpoint: is_cancelled raised {type(exc).__name__}: {exc}")
                continue
            finally:
                self.ask_s += time.perf_counter() - started
            if gone:
                res.fail(Cancelled("the request was cancelled by its client: its texts still to go were not sent"))

    async def _one(self, sub: SubBatch, results: Sequence[Result], in_flight: asyncio.Semaphore,
                   held: asyncio.Lock | None, slot: bool) -> None:
        """One sub-batch: pad the rows still going, call the encoder, fill in or fail its requests. Never raises."""
        try:
            started, arrays = self._start(sub, results)
            if arrays is None:
                return
            out: Any = None
            error: TextError | None = None
            try:
                out = await self.encode(*arrays)
            except TextError as exc:
                error = exc.with_traceback(None)
            except Exception as exc:
                error = EncoderFailed(f"encoder call failed: {type(exc).__name__}: {exc}")
            self._finish(sub, results, arrays, out, error, started)
        except Exception as exc:
            self._crashed(sub, results, exc)
        finally:
            self._release(in_flight, held, slot)

    def _start(self, sub: SubBatch, results: Sequence[Result]
               ) -> tuple[float, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None]:
        """(start time, padded arrays of the rows still going or None); counts the requests starting now."""
        arrays = pad(sub, results, self.pad_id, self.s.pad_to_multiple)
        started = self.clock()
        if arrays is None:
            return started, None
        first = {r: results[r] for r, _ in sub.sent if not results[r].launched}
        for res in first.values():
            res.launched = True
        with self.counters.lock:  # requests whose first sub-batch starts now, and their wait in this execute
            self.counters.queued += len(first)
            self.counters.queue_us += sum(int((started - (res.queued_at or started)) * 1e6) for res in first.values())
        return started, arrays

    @staticmethod
    def _call(fn: Callable[[], Any]) -> tuple[Any, TextError | None]:
        """A blocking encoder call: (answer, None) or (None, the error it raised as a TextError)."""
        try:
            return fn(), None
        except TextError as exc:
            return None, exc.with_traceback(None)
        except Exception as exc:
            return None, EncoderFailed(f"encoder call failed: {type(exc).__name__}: {exc}")

    def _finish(self, sub: SubBatch, results: Sequence[Result],
                arrays: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]], out: Any, error: TextError | None,
                started: float) -> None:
        """Check the answer's shape, count, and fill in (or fail) the sub-batch's requests."""
        ended = self.clock()
        ids, mask = arrays
        arr = None
        if error is None:
            arr, error = check(out, len(sub.sent), self.dim, self.s.onnx_model)
        with self.counters.lock:
            self.counters.subs += 1
            self.counters.padded += ids.size
            self.counters.real += int(mask.sum())
            self.counters.texts += len(sub.sent) if error is None else 0
        accept(sub, results, arr, error, started, ended)

    def _crashed(self, sub: SubBatch, results: Sequence[Result], exc: Exception) -> None:
        """A bug around one sub-batch: its requests still going fail INTERNAL; the rest of the batch goes on."""
        self.log(f"text endpoint: a sub-batch raised {type(exc).__name__}: {exc}")
        for r, _, _ in sub.rows:
            if not results[r].done:
                results[r].fail(EncoderFailed(f"text endpoint failed on a sub-batch: {type(exc).__name__}: {exc}"))


def _answered() -> Result:
    """A stand-in for a request answered before planning (never planned, so never read)."""
    res = Result(0, 0, np.zeros((0, 0), np.float32), np.zeros(0, np.int32))
    res.error = EncoderFailed("answered already")
    return res


_ANSWERED = _answered()

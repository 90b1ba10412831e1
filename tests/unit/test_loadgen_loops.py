"""loadgen.open_loop / closed_loop over any async caller: each request gets one outcome (ok, error kind, lost)."""
from __future__ import annotations

import asyncio
import gc
import itertools

from bge_triton.errors import Overloaded
from bge_triton.loadtest import loadgen, report


def test_open_loop_labels_each_request_once() -> None:
    seen: list[tuple[float, str]] = []

    async def call(t: float) -> None:
        if t == 2.0:
            raise Overloaded("queue full")
        if t == 3.0:
            raise TimeoutError("the call's own timeout")  # its kind, not "lost"
        if t == 4.0:
            await asyncio.Event().wait()  # never answers: lost at the deadline

    async def times():
        for t in (1.0, 2.0, 3.0, 4.0):
            yield t

    clock = itertools.count(100.0)
    sent = asyncio.run(loadgen.open_loop(call, times(), lambda: next(clock), lambda t, done, kind, err:
                                         seen.append((t, kind)), deadline_s=0.05))
    assert sent == 4
    assert sorted(seen) == [(1.0, "ok"), (2.0, "Overloaded"), (3.0, "raw:TimeoutError"), (4.0, "lost")]


def test_open_loop_keeps_no_finished_request() -> None:
    """A soak sends 400k requests through one open loop: the loop must hold only the unfinished ones, or the client's
    RSS (and its garbage collector's pauses, in the latencies) measure the harness instead of the SDK."""
    alive: list[int] = []

    async def call(_t: float) -> None:
        await asyncio.sleep(0)

    async def times():
        for k in range(2000):
            yield float(k)
            await asyncio.sleep(0)  # the previous request finishes before the next is scheduled
        gc.collect()
        alive.append(sum(isinstance(o, asyncio.Task) for o in gc.get_objects()))

    sent = asyncio.run(loadgen.open_loop(call, times(), lambda: 0.0, lambda *_: None))
    assert sent == 2000 and alive[0] < 20  # was 2000: every Task the loop had started


def test_closed_loop_counts_successes_and_records_errors() -> None:
    calls, kinds = itertools.count(), []

    async def call(k: int) -> None:
        if next(calls) % 3 == 2:
            raise Overloaded("busy")

    turns = itertools.count()
    ok = asyncio.run(loadgen.closed_loop(call, 2, lambda: next(turns) >= 9, lambda k, t, kind, err: kinds.append(kind),
                                         now=lambda: 0.0))
    assert ok == kinds.count("ok") and kinds.count("Overloaded") == len(kinds) - ok and len(kinds) == 9


def test_table_takes_a_header_string_or_names() -> None:
    assert report.table("a | b", [[1, 2.25], [None, "x"]]) == report.table(["a", "b"], [[1, 2.25], [None, "x"]])
    assert report.table("a | b", [[None, 2.25]]) == ["| a | b |", "|---|---|", "| - | 2.2 |"]

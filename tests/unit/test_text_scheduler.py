"""The text endpoint's scheduler (text_scheduler.py): the run it picks, priorities, query mode, limits."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from test_text_core_stages import DIM, Endpoint, FakeEncoder, req
from text_core import EncoderOverloaded, TextSettings
from text_scheduler import Item, Job, QueryMarker, choose


def items(lengths, arrivals=None) -> list[Item]:
    job = Job(len(lengths), 2, np.zeros((len(lengths), DIM), np.float32), np.zeros(len(lengths), np.int32))
    arrivals = arrivals or [0.0] * len(lengths)
    return [Item(job, i, [1] * n, -(-n // 8) * 8, t) for i, (n, t) in enumerate(zip(lengths, arrivals))]


def taken(p: Endpoint) -> None:
    """Wait until the dispatchers took every pending text."""
    for _ in range(500):
        if p.scheduler.pending == 0:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the dispatcher never took the pending texts")


def test_choose_takes_the_cheapest_run_of_similar_lengths() -> None:
    pool = items([100, 12, 9, 15, 200, 14, 10])
    run = choose(pool, now=0.0, budget=8192, max_batch=4, overhead=64, max_wait_s=1.0)
    assert sorted(it.padded for it in run) == [16, 16, 16, 16]  # four short texts, not the long ones
    ties = choose(pool, now=0.0, budget=8192, max_batch=64, overhead=0, max_wait_s=1.0)
    assert [it.padded for it in ties] == [16] * 5  # equal cost per text: the wider run


def test_choose_keeps_the_token_budget_and_runs_a_lone_long_text() -> None:
    pool = items([120, 120, 120, 500])
    run = choose(pool, 0.0, budget=256, max_batch=64, overhead=1000, max_wait_s=1.0)
    assert len(run) == 2 and all(it.padded == 120 for it in run)  # 3 x 120 would pass 256 tokens
    assert [it.padded for it in choose(items([500]), 0.0, 256, 64, 1000, 1.0)] == [504]


def test_an_old_text_forces_its_run() -> None:
    pool = items([10, 11, 12, 300], arrivals=[1.0, 1.0, 1.0, 0.0])
    assert all(it.padded == 16 for it in choose(pool, 0.1, 8192, 64, 64, max_wait_s=0.2))
    forced = choose(pool, 0.3, 8192, 64, 64, max_wait_s=0.2)  # the long text has waited 0.3 s
    assert 304 in [it.padded for it in forced]


def test_queries_go_first_and_bulk_is_capped_in_query_mode() -> None:
    gate = threading.Event()

    class Gated(FakeEncoder):
        def run(self, ids, mask):
            gate.wait(5)
            return super().run(ids, mask)

    enc = Gated()
    p = Endpoint(enc, max_in_flight=1, query_token_budget=16, sub_batch_max=64, max_wait_ms=10_000)
    first = p.submit([req("hello")])  # runs (held at the gate)
    taken(p)
    bulk = p.submit([req("hello world", "fast embeddings", "rag rag", "world fast")])
    query = p.submit([req("今天天气很好", priority=1)])
    gate.set()
    p.wait(first + bulk + query)
    assert enc.shapes[1] == (1, 8)  # the query, before the bulk that was waiting
    assert all(rows * length <= 16 for rows, length in enc.shapes[2:])  # bulk capped while queries are recent
    assert len(enc.shapes) == 2 + 2  # four bulk texts of <= 8 padded tokens: two runs of two
    p.close()


def test_without_recent_queries_bulk_uses_the_full_budget() -> None:
    enc = FakeEncoder()
    p = Endpoint(enc, max_in_flight=1, query_token_budget=16, query_window_s=0.0)
    p([req("hello world", "fast embeddings", "rag rag", "world fast")])
    assert enc.shapes == [(4, 8)]
    p.close()


def test_max_pending_refuses_with_unavailable_and_keeps_the_rest() -> None:
    gate = threading.Event()

    class Gated(FakeEncoder):
        def run(self, ids, mask):
            gate.wait(5)
            return super().run(ids, mask)

    p = Endpoint(Gated(), max_in_flight=1, max_pending=3)
    held = p.submit([req("hello")])
    taken(p)  # the dispatcher holds it: not pending
    kept = p.submit([req("world", "fast")])
    refused = p.submit([req("rag", "rag", "hello")])
    gate.set()
    p.wait(held + kept + refused)
    assert isinstance(refused[0].error, EncoderOverloaded) and "max_pending 3" in str(refused[0].error)
    assert held[0].error is None and kept[0].error is None and kept[0].out.shape == (2, DIM)
    p.close()


def test_close_answers_what_is_still_waiting() -> None:
    gate = threading.Event()

    class Gated(FakeEncoder):
        def run(self, ids, mask):
            gate.wait(5)
            return super().run(ids, mask)

    p = Endpoint(Gated(), max_in_flight=1)
    running = p.submit([req("hello")])
    taken(p)
    waiting = p.submit([req("world")])
    threading.Timer(0.2, gate.set).start()
    p.close()
    p.wait(running + waiting)
    assert running[0].error is None
    assert isinstance(waiting[0].error, EncoderOverloaded) and "unloading" in str(waiting[0].error)


def test_query_marker_is_shared_through_its_file() -> None:
    a, b = QueryMarker("m/odd name", server_pid=424242), QueryMarker("m/odd name", server_pid=424242)
    try:
        assert a.path == b.path and "m_odd_name_424242" in a.path
        a.mark(12.5)
        assert b.last() == 12.5
        assert a.try_bulk()
        other = QueryMarker.__new__(QueryMarker)  # a second open file description: another instance
        other.fd = os.open(a.path, os.O_RDWR)
        assert not other.try_bulk()
        a.release_bulk()
        assert other.try_bulk()
        other.release_bulk()
        os.close(other.fd)
    finally:
        a.close()
        b.close()
        os.unlink(a.path)


def test_settings_reject_negative_scheduler_values() -> None:
    for name in ("max_wait_ms", "query_window_s", "query_levels"):
        with pytest.raises(ValueError, match=name):
            TextSettings(**{name: -1})
    with pytest.raises(ValueError, match="max_pending"):
        TextSettings(max_pending=0)

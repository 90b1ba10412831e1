"""The text endpoint's scheduler (text_scheduler.py): the run it picks, priorities, query mode, limits."""
from __future__ import annotations

import gc
import os
import threading
import weakref

import numpy as np
import pytest
from test_text_core_stages import DIM, Endpoint, FakeEncoder, req

from bge_triton.repository import endpoint_modules

text_core, _, text_scheduler = endpoint_modules()
EncoderOverloaded, TextSettings = text_core.EncoderOverloaded, text_core.TextSettings
encoder_error = text_core.encoder_error
Item, Job, QueryMarker = text_scheduler.Item, text_scheduler.Job, text_scheduler.QueryMarker
QueuePolicy, choose = text_scheduler.QueuePolicy, text_scheduler.choose


def items(lengths, arrivals=None) -> list[Item]:
    job = Job(len(lengths), 2, np.zeros((len(lengths), DIM), np.float32), np.zeros(len(lengths), np.int32))
    arrivals = arrivals or [0.0] * len(lengths)
    return [Item(job, i, [1] * n, -(-n // 8) * 8, t) for i, (n, t) in enumerate(zip(lengths, arrivals, strict=True))]


def taken(p: Endpoint) -> None:
    """Wait (by the scheduler's condition, bounded against a hang) until the dispatchers took every pending text."""
    p.taken()


def test_choose_sends_the_run_of_the_oldest_text_from_the_whole_pool_plan() -> None:
    pool = items([100, 12, 9, 15, 200, 14, 10], arrivals=[0.5, 0.4, 0.3, 0.2, 0.6, 0.1, 0.7])
    run = choose(pool, budget=8192, max_batch=4, overhead=64)
    lengths = sorted(it.padded for it in run)
    assert lengths == [16] * 4 and 14 in [len(it.ids) for it in run]  # the oldest (14 tokens) and 3 of its kind
    long_first = items([100, 12, 9, 15, 200, 14, 10], arrivals=[0.0, 0.4, 0.3, 0.2, 0.6, 0.1, 0.7])
    assert [it.padded for it in choose(long_first, 8192, 4, 64)] == [104]  # not padded together with short ones


def test_choose_keeps_the_token_budget_and_runs_a_lone_long_text() -> None:
    pool = items([120, 120, 120, 500])
    run = choose(pool, budget=256, max_batch=64, overhead=1000)
    assert len(run) == 2 and all(it.padded == 120 for it in run)  # 3 x 120 would pass 256 tokens
    assert [it.padded for it in choose(items([500]), 256, 64, 1000)] == [504]


def test_a_bigger_pool_plans_fuller_runs() -> None:
    import random

    rng = random.Random(0)
    lengths = [rng.choice([12, 20, 33, 48, 71, 90, 130, 250]) for _ in range(256)]
    small = choose(items(lengths[:8]), 8192, 64, 628)
    big = choose(items(lengths), 8192, 64, 628)
    assert len(big) > len(small)


class Gated(FakeEncoder):
    """Records each call's shape as it arrives, then waits for the gate (bounded against a hang only: a gate that
    opened by itself after a few seconds let a held sub-batch go while a slow test still counted on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.arrived, self.came = threading.Event(), [], threading.Condition()

    def run(self, ids, mask):
        with self.came:
            self.arrived.append(ids.shape)
            self.came.notify_all()
        assert self.gate.wait(60), "the test never opened the gate"
        return super().run(ids, mask)

    def wait_arrived(self, n: int) -> None:
        with self.came:
            assert self.came.wait_for(lambda: len(self.arrived) >= n, 30), \
                f"{len(self.arrived)} encoder calls arrived, expected {n}"


def test_a_query_does_not_wait_for_bulk_and_bulk_is_capped_in_query_mode() -> None:
    enc = Gated()
    p = Endpoint(enc, max_in_flight=1, query_token_budget=16, sub_batch_max=64)
    first = p.submit([req("hello")])  # the one general dispatcher runs it (held at the gate)
    enc.wait_arrived(1)
    bulk = p.submit([req("hello world", "fast embeddings", "rag rag", "world fast")])  # waits for that dispatcher
    query = p.submit([req("今天天气很好", priority_level=1)])  # the query dispatcher takes it at once
    enc.wait_arrived(2)
    assert enc.arrived[1] == (1, 8) and p.scheduler.pending == 4  # the query is at the encoder, bulk still waits
    enc.gate.set()
    p.wait(first + bulk + query)
    assert all(rows * length <= 16 for rows, length in enc.arrived[2:])  # bulk capped while queries are recent
    assert len(enc.arrived) == 2 + 2  # four bulk texts of 8 padded tokens: two runs of two
    p.close()


def test_without_recent_queries_bulk_uses_the_full_budget() -> None:
    enc = FakeEncoder()
    p = Endpoint(enc, max_in_flight=1, query_token_budget=16, query_window_s=0.0)
    p([req("hello world", "fast embeddings", "rag rag", "world fast")])
    assert enc.shapes == [(4, 8)]
    p.close()


def test_max_queue_size_counts_texts_refuses_with_unavailable_and_keeps_the_rest() -> None:
    enc = Gated()
    p = Endpoint(enc, policy=QueuePolicy(max_queue_size=3), max_in_flight=1, query_levels=0)
    held = p.submit([req("hello")])
    taken(p)  # the dispatcher holds it: not pending
    kept = p.submit([req("world", "fast")])  # 2 texts wait: within 3
    refused = p.submit([req("rag", "rag")])  # 2 more would make 4 texts: refused, although only 1 request waits
    one = p.submit([req("rag")])  # 3 texts: fits
    enc.gate.set()
    p.wait(held + kept + refused + one)
    assert isinstance(refused[0].error, EncoderOverloaded)
    assert str(refused[0].error).startswith("Exceeds maximum queue size: 2 texts wait at priority level 2")
    assert held[0].error is None and kept[0].error is None and kept[0].out.shape == (2, DIM) and one[0].error is None
    p.close()


def test_a_bulk_backlog_never_refuses_a_query() -> None:
    """One limit per priority level, as Triton's queue keeps them: bulk fills its own, queries still get in."""
    enc = Gated()
    p = Endpoint(enc, policy=QueuePolicy(max_queue_size=4), max_in_flight=1)
    held = p.submit([req("hello")])
    enc.wait_arrived(1)
    bulk = p.submit([req("world", "fast", "rag", "hello")])  # level 2 is full
    more_bulk = p.submit([req("world")])
    query = p.submit([req("今天", priority_level=1), req("rag", priority_level=1)])
    assert isinstance(more_bulk[0].error, EncoderOverloaded) and more_bulk[0] in p.answered
    assert query[0] not in p.answered and query[1] not in p.answered  # queued, not refused
    enc.gate.set()
    p.wait(held + bulk + query)
    assert all(j.error is None for j in held + bulk + query)
    p.close()


def test_queue_policy_per_level_and_timeout_override_come_from_the_config_json() -> None:
    cfg = {"dynamic_batching": {
        "default_queue_policy": {"default_timeout_microseconds": "5000000", "max_queue_size": 2048,
                                 "allow_timeout_override": True},
        "priority_queue_policy": {"1": {"max_queue_size": 64, "default_timeout_microseconds": "1000000"}}}}
    policy = QueuePolicy.from_config(cfg)
    assert policy.allow_timeout_override and policy.of(1) == (64, 1.0) and policy.of(2) == (2048, 5.0)


def test_close_answers_what_is_still_waiting() -> None:
    enc = Gated()
    p = Endpoint(enc, max_in_flight=1)
    running = p.submit([req("hello")])
    taken(p)
    waiting = p.submit([req("world")])

    def open_once_closing() -> None:  # the held sub-batch returns during close(), after the unload began
        with p.scheduler.cond:
            p.scheduler.cond.wait_for(lambda: p.scheduler.closing, 30)
        enc.gate.set()

    opener = threading.Thread(target=open_once_closing, daemon=True)
    opener.start()  # (a timer of 0.2 s raced close(): opened first, the dispatcher ran "world" and it embedded)
    p.close()
    opener.join(30)
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
        b.close()  # the second close finds the file gone: fine
    assert not os.path.exists(a.path)


def test_settings_reject_negative_scheduler_values() -> None:
    for name in ("split_overhead_tokens", "query_window_s", "query_levels"):
        with pytest.raises(ValueError, match=name):
            TextSettings(**{name: -1})
    with pytest.raises(ValueError, match="query_token_budget"):
        TextSettings(query_token_budget=0)


def test_queue_policy_comes_from_the_config_json() -> None:
    cfg = {"dynamic_batching": {"default_queue_policy": {"default_timeout_microseconds": "5000000",
                                                         "max_queue_size": 2048}}}
    assert QueuePolicy.from_config(cfg) == QueuePolicy(2048, 5.0)
    assert QueuePolicy.from_config({}) == QueuePolicy(0, 0.0)


def test_a_text_waiting_past_the_queue_timeout_fails_its_request_unavailable() -> None:
    now = [100.0]
    enc = Gated()
    p = Endpoint(enc, policy=QueuePolicy(timeout_s=5.0), max_in_flight=1)
    p.scheduler.clock = lambda: now[0]
    running = p.submit([req("hello")])
    enc.wait_arrived(1)
    late = p.submit([req("world", "fast")])
    now[0] += 6.0  # the encoder is stuck on the first sub-batch for 6 s
    enc.gate.set()
    p.wait(running + late)
    assert running[0].error is None
    assert isinstance(late[0].error, EncoderOverloaded)
    assert str(late[0].error).startswith("Request timeout expired: a text waited 6.0 s")
    assert p.answered.count(late[0]) == 1 and p.scheduler.pending == 0
    p.close()


def test_run_inline_only_when_idle_one_sub_batch_and_not_bulk_in_query_mode() -> None:
    enc = Gated()
    enc.gate.set()
    p = Endpoint(enc, max_in_flight=1, sub_batch_max=2)
    job = lambda n, prio=2: p.scheduler.new_job(n, prio)  # noqa: E731
    one = job(2)
    assert p.scheduler.run_inline([(one, [[2, 5, 3], [2, 6, 3]])]) and one.error is None
    assert one.tokens.tolist() == [3, 3] and enc.arrived == [(2, 8)] and p.answered == []  # not sent: returned
    assert not p.scheduler.run_inline([(job(3), [[2, 3]] * 3)])  # three texts: two sub-batches
    query = job(1, prio=1)
    p.scheduler.submit([(query, [[2, 7, 3]])])  # a query: query mode for a second
    p.wait([query])
    p.idle()  # its dispatcher is done with it (it answers before it leaves)
    assert not p.scheduler.run_inline([(job(1), [[2, 3]])])  # bulk in query mode: to the pool, capped
    assert p.scheduler.run_inline([(job(1, prio=1), [[2, 3]])])  # a query still may
    p.close()


def test_a_query_run_inline_opens_query_mode_too() -> None:
    """An idle instance runs a lone query inline: bulk right after it is still capped, as after a submitted one."""
    enc = Gated()
    enc.gate.set()
    p = Endpoint(enc, max_in_flight=1)
    assert p.scheduler.run_inline([(p.scheduler.new_job(1, 1), [[2, 7, 3]])])  # the query, inline
    assert not p.scheduler.run_inline([(p.scheduler.new_job(1, 2), [[2, 3]])])  # bulk: to the pool, capped
    p.close()


def test_queue_time_counts_the_wait_in_the_pool() -> None:
    now = [100.0]
    enc = Gated()
    p = Endpoint(enc, max_in_flight=1)
    p.scheduler.clock = lambda: now[0]
    first = p.submit([req("hello")])
    enc.wait_arrived(1)  # taken at once: waited 0
    second = p.submit([req("world", "fast")])
    now[0] += 0.5  # the encoder holds the first sub-batch for half a second
    enc.gate.set()
    p.wait(first + second)
    counts = p.scheduler.counters.take()
    assert counts["queued"] == 2 and counts["queue_us"] == 500_000
    inline = p.scheduler.new_job(1, 2)
    p.idle()  # the dispatcher is done: the next one-sub-batch request runs inline
    now[0] += 0.5
    assert p.scheduler.run_inline([(inline, [[2, 5, 3]])])
    counts = p.scheduler.counters.take()
    assert counts["queued"] == 1 and counts["queue_us"] == 0 and counts["texts"] == 1
    p.close()


class Failing(FakeEncoder):
    """Holds a stand-in for the encoder's response (pb_utils objects in shared memory) in its frame, then
    fails as BlsBackend does on an error response."""

    def __init__(self) -> None:
        super().__init__()
        self.responses: list[weakref.ref] = []

    def run(self, ids, mask):
        response = Response()
        self.responses.append(weakref.ref(response))
        raise encoder_error("fake_onnx", "Exceeds maximum queue size")


class Response:
    pass


def test_an_encoder_error_keeps_no_frame_alive() -> None:
    """The encoder's response goes when its job is answered, by reference counting alone. An error kept with
    its traceback holds the raising frames in a cycle, and the 2.51 stub segfaults when such a pb object is
    freed by the interpreter's last collection, after the stub's shared memory (model.py finalize also
    collects)."""
    enc = Failing()
    p = Endpoint(enc, max_in_flight=1)
    gc.disable()
    try:
        jobs = p.submit([req("hello")]) + p.submit([req("world", "rag")])
        p.wait(jobs)
        assert all(isinstance(j.error, EncoderOverloaded) for j in jobs) and enc.responses
        assert all(j.error.__traceback__ is None for j in jobs)
        assert [r() for r in enc.responses] == [None] * len(enc.responses), "a response outlived its job's answer"
    finally:
        gc.enable()
        p.close()


# --- age bound (age_bound_s): a long text is not overtaken by shorter ones that arrived much later -------------


def test_an_age_bound_keeps_later_short_texts_from_overtaking_a_waiting_long_one() -> None:
    """Fake clock: a short text (t=100.0), a long one (t=100.1), then four short ones (t=101.0) wait behind a held
    sub-batch. Unbounded, the oldest short one leaves with the later short ones and the long one waits; with
    age_bound_s 0.5 the later ones (0.9 s younger than the long one) may not leave before it."""
    def order(age_bound_s: float) -> list[tuple[int, int]]:
        now = [100.0]
        enc = Gated()
        p = Endpoint(enc, age_bound_s=age_bound_s, max_in_flight=1, query_levels=0,
                     split_overhead_tokens=1)
        p.scheduler.clock = lambda: now[0]
        held = p.submit([req("hello")])
        enc.wait_arrived(1)  # the dispatcher is at the encoder: what follows waits in the pool
        first = p.submit([req("world")])  # 3 tokens: padded 8
        now[0] = 100.1
        long = p.submit([req("rag " * 9)])  # 11 tokens: padded 16
        now[0] = 101.0
        later = p.submit([req("fast"), req("hello"), req("world"), req("rag")])
        enc.gate.set()
        p.wait(held + first + long + later)
        p.close()
        return enc.arrived[1:]

    assert order(0.0) == [(5, 8), (1, 16)]  # unbounded: four later short texts leave before the long one
    assert order(0.5) == [(1, 8), (1, 16), (4, 8)]  # bounded: the long one goes before anything 0.5 s younger


def test_an_age_bound_still_groups_a_backlog_sent_at_once_by_length() -> None:
    """Texts that arrived together are not reordered by the bound: the run is the unbounded one."""
    import random

    rng = random.Random(1)
    lengths = [rng.choice([12, 20, 33, 48, 71, 90, 130]) for _ in range(300)]
    arrivals = [0.001 * (i // 64) for i in range(300)]  # 64 texts per request, requests 1 ms apart
    plain = choose(items(lengths, arrivals), 8192, 64, 628)
    bounded = choose(items(lengths, arrivals), 8192, 64, 628, age_bound_s=0.5)
    assert [(it.row, it.padded) for it in bounded] == [(it.row, it.padded) for it in plain]
    assert len({it.padded for it in plain}) <= 2  # and that run is length-grouped, not FIFO


def test_choose_with_an_age_bound_never_takes_a_text_that_arrived_later_than_the_bound() -> None:
    import random

    rng = random.Random(2)
    lengths = [rng.choice([12, 20, 33, 48, 71, 90, 130]) for _ in range(200)]
    arrivals = sorted(rng.uniform(0.0, 4.0) for _ in range(200))
    for bound in (0.05, 0.5, 1.0):
        run = choose(items(lengths, arrivals), 8192, 64, 628, age_bound_s=bound)
        assert run and max(it.arrival for it in run) <= min(arrivals) + bound
        assert min(it.arrival for it in run) == min(arrivals)  # the oldest text is always in the next run
    unbounded = choose(items(lengths, arrivals), 8192, 64, 628)
    assert max(it.arrival for it in unbounded) > min(arrivals) + 1.0  # without it, far younger texts ride along


def test_age_bound_comes_from_the_config_parameters_and_is_checked() -> None:
    assert TextSettings.from_params({"age_bound_s": "0.25"}).age_bound_s == 0.25
    assert TextSettings.from_params({}).age_bound_s == 0.0
    for bad, why in (("-1", "must be >= 0"), ("soon", "not a valid float"), ("nan", "must be >= 0")):
        with pytest.raises(ValueError, match=why):
            TextSettings.from_params({"age_bound_s": bad})

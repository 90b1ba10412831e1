"""Unit tests of the micro-batcher with a fake async embed function (no server), on a virtual-time loop: its
max_wait window and the fake's delays run on a clock that a busy machine cannot stretch (aiotools.VirtualClock:
loop.time() moves only when every task waits on a timer, and then jumps to that timer)."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from aiotools import VirtualClock

from bge_triton.client.batcher import MicroBatcher
from bge_triton.client.errors import InputError, KitError, Overloaded


class FakeEmbed:
    """Async embed fn: vector = [len(text), hash-ish]; records batches; optional delay and failures."""

    def __init__(self, delay: float = 0.0, fail_on: str | None = None, error: Exception | None = None) -> None:
        self.delay, self.fail_on, self.error = delay, fail_on, error
        self.batches: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.overload_on: str | None = None

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        self.batches.append(list(texts))
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        if self.overload_on is not None and self.overload_on in texts:
            raise Overloaded("Exceeds maximum queue size")
        if self.fail_on is not None and self.fail_on in texts:
            raise InputError(f"bad text {self.fail_on!r}")
        return np.array([[float(len(t)), float(sum(map(ord, t)))] for t in texts], dtype=np.float32)


def vec(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)))]


def run(coro):
    async def main():
        with VirtualClock().patch_loop():
            return await asyncio.wait_for(coro, 20)  # 20 virtual seconds: a hang fails at once

    return asyncio.run(main())


def test_dispatches_at_once_when_idle() -> None:
    async def main() -> float:
        fake = FakeEmbed()
        async with MicroBatcher(fake, max_batch=32, max_wait_s=5.0) as mb:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            out = await mb.embed("hello")
            elapsed = loop.time() - t0
        assert out.tolist() == vec("hello") and fake.batches == [["hello"]]
        return elapsed

    assert run(main()) == 0.0  # no timer ran (virtual time): the seed design waited its 5 s window here


def test_batches_under_load_and_each_caller_gets_its_vector() -> None:
    async def main() -> None:
        fake = FakeEmbed(delay=0.02)
        async with MicroBatcher(fake, max_batch=16, max_wait_s=0.01, max_in_flight=2) as mb:
            texts = [f"text-{i}" * (i % 5 + 1) for i in range(200)]
            results = await asyncio.gather(*(mb.embed(t) for t in texts))
        for text, result in zip(texts, results, strict=True):
            assert result.tolist() == vec(text)
        sizes = [len(b) for b in fake.batches]
        assert sum(sizes) == 200 and max(sizes) <= 16
        assert len(fake.batches) < 50 and mb.stats()["mean_batch"] > 4

    run(main())


def test_max_wait_applies_only_while_busy() -> None:
    async def main() -> None:
        fake = FakeEmbed()
        fake.gate = asyncio.Event()
        mb = MicroBatcher(fake, max_batch=8, max_wait_s=0.05, max_in_flight=2)
        first = asyncio.ensure_future(mb.embed("first"))
        await asyncio.sleep(0.01)
        assert fake.batches == [["first"]]  # idle -> sent at once
        rest = [asyncio.ensure_future(mb.embed(f"t{i}")) for i in range(3)]  # enqueued at t = 0.01
        await asyncio.sleep(0.049)
        assert len(fake.batches) == 1  # t = 0.059: busy and not full -> waits for the window (until 0.06)
        await asyncio.sleep(0.002)
        assert fake.batches[1] == ["t0", "t1", "t2"]  # t = 0.061: window expired -> one batch of 3
        fake.gate.set()
        await asyncio.gather(first, *rest)
        await mb.aclose()

    run(main())


def test_full_batch_goes_without_waiting() -> None:
    async def main() -> None:
        fake = FakeEmbed()
        fake.gate = asyncio.Event()
        mb = MicroBatcher(fake, max_batch=4, max_wait_s=10.0, max_in_flight=2)
        first = asyncio.ensure_future(mb.embed("first"))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(mb.embed(f"t{i}")) for i in range(4)]
        await asyncio.sleep(0.02)
        assert fake.batches[1] == ["t0", "t1", "t2", "t3"]
        fake.gate.set()
        await asyncio.gather(first, *rest)
        await mb.aclose()

    run(main())


def test_backpressure_bounded_queue() -> None:
    async def main() -> None:
        fake = FakeEmbed()
        fake.gate = asyncio.Event()
        mb = MicroBatcher(fake, max_batch=2, max_queue=3, max_in_flight=1, queue_timeout_s=0.05)
        first = asyncio.ensure_future(mb.embed("a"))  # in flight, holds no queue slot
        await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(mb.embed(t)) for t in "bcd"]
        await asyncio.sleep(0.01)
        assert mb.queued == 3
        with pytest.raises(Overloaded, match="queue full"):
            await mb.embed("e")
        fake.gate.set()
        assert [r.tolist() for r in await asyncio.gather(first, *queued)] == [vec(t) for t in "abcd"]
        await mb.aclose()

    run(main())


def test_backpressure_waits_for_room_without_timeout() -> None:
    async def main() -> None:
        fake = FakeEmbed(delay=0.01)
        async with MicroBatcher(fake, max_batch=2, max_queue=2, max_in_flight=1) as mb:
            results = await asyncio.gather(*(mb.embed(f"x{i}") for i in range(20)))
        assert [r.tolist() for r in results] == [vec(f"x{i}") for i in range(20)]

    run(main())


def test_cancellation_is_safe() -> None:
    async def main() -> None:
        fake = FakeEmbed()
        fake.gate = asyncio.Event()
        mb = MicroBatcher(fake, max_batch=8, max_wait_s=0.0, max_in_flight=1)
        in_flight = asyncio.ensure_future(mb.embed("inflight"))
        await asyncio.sleep(0.01)
        queued = {t: asyncio.ensure_future(mb.embed(t)) for t in ("keep1", "drop", "keep2")}
        await asyncio.sleep(0.01)
        queued["drop"].cancel()
        in_flight.cancel()  # its result will be discarded
        fake.gate.set()
        assert (await queued["keep1"]).tolist() == vec("keep1")
        assert (await queued["keep2"]).tolist() == vec("keep2")
        assert fake.batches[1] == ["keep1", "keep2"]  # the cancelled text was dropped
        for task in (in_flight, queued["drop"]):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (await mb.embed("after")).tolist() == vec("after")
        await mb.aclose()

    run(main())


def test_aclose_finishes_queued_work_then_refuses() -> None:
    async def main() -> None:
        fake = FakeEmbed(delay=0.01)
        mb = MicroBatcher(fake, max_batch=4, max_wait_s=1.0, max_in_flight=1)
        tasks = [asyncio.ensure_future(mb.embed(f"q{i}")) for i in range(10)]
        await asyncio.sleep(0)
        await mb.aclose()
        assert all(t.done() for t in tasks)
        assert [t.result().tolist() for t in tasks] == [vec(f"q{i}") for i in range(10)]
        with pytest.raises(KitError, match="closed"):
            await mb.embed("late")

    run(main())


def test_aclose_timeout_fails_in_flight_callers() -> None:
    async def main() -> None:
        fake = FakeEmbed()
        fake.gate = asyncio.Event()  # never opened
        mb = MicroBatcher(fake, max_batch=4)
        task = asyncio.ensure_future(mb.embed("stuck"))
        await asyncio.sleep(0.01)
        await mb.aclose(timeout_s=0.05)
        with pytest.raises(KitError, match="closed"):
            await task

    run(main())


def test_error_fan_out_reaches_exactly_its_batch() -> None:
    async def main() -> None:
        fake = FakeEmbed()
        fake.gate = asyncio.Event()
        fake.overload_on = "d1"
        mb = MicroBatcher(fake, max_batch=3, max_wait_s=0.0, max_in_flight=1)
        first = asyncio.ensure_future(mb.embed("ok-first"))
        await asyncio.sleep(0.01)
        doomed = [asyncio.ensure_future(mb.embed(f"d{i}")) for i in range(3)]
        fine = [asyncio.ensure_future(mb.embed(f"f{i}")) for i in range(2)]
        await asyncio.sleep(0.01)
        fake.gate.set()
        results = await asyncio.gather(first, *doomed, *fine, return_exceptions=True)
        assert fake.batches == [["ok-first"], ["d0", "d1", "d2"], ["f0", "f1"]]
        assert results[0].tolist() == vec("ok-first")
        assert all(isinstance(r, Overloaded) for r in results[1:4])  # the whole batch, not retried alone
        assert [r.tolist() for r in results[4:]] == [vec("f0"), vec("f1")]
        await mb.aclose()

    run(main())


def test_input_error_only_reaches_the_bad_text() -> None:
    async def main() -> None:
        fake = FakeEmbed(delay=0.01, fail_on="BAD")
        async with MicroBatcher(fake, max_batch=8, max_in_flight=1) as mb:
            texts = ["a", "b", "BAD", "c", "d", "e"]
            results = await asyncio.gather(*(mb.embed(t) for t in texts), return_exceptions=True)
        for text, result in zip(texts, results, strict=True):
            if text == "BAD":
                assert isinstance(result, InputError)
            else:
                assert result.tolist() == vec(text)
        with pytest.raises(InputError, match="empty"):
            await mb.embed(" ")  # invalid text rejected before queueing

    run(main())


def test_bad_arguments() -> None:
    with pytest.raises(InputError):
        MicroBatcher(FakeEmbed(), max_batch=0)

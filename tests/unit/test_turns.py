"""The one alternating-turns helper (loadtest/turns.py): ABBA order, blocks, per-leg results and metering."""
from __future__ import annotations

import asyncio

from bge_triton.loadtest.turns import abba, blocks, take_turns, take_turns_async


def test_abba_reverses_the_legs_every_other_round() -> None:
    assert [leg for _, leg in abba("ABC", 4)] == list("ABCCBAABCCBA")
    assert [k for k, _ in abba(["x", "y"], 3)] == [0, 0, 1, 1, 2, 2] and list(abba(["x"], 0)) == []


def test_blocks_cut_items_in_order_the_last_shorter() -> None:
    assert blocks(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]] and blocks([], 3) == []


def test_take_turns_keeps_each_legs_results_in_round_order_and_meters_its_own_turns() -> None:
    clock, order = [0.0], []

    def run(k: int, leg: str) -> str:
        order.append(leg)
        clock[0] += {"a": 1.0, "b": 10.0}[leg]  # what the meter sees during this leg's turn
        return f"{leg}{k}"

    results, used = take_turns(["a", "b"], 3, run, lambda: clock[0])
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert results == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]} and used == {"a": 3.0, "b": 30.0}
    assert take_turns(["a"], 2, lambda k, _leg: k)[1] == {"a": 0.0}  # no meter: nothing metered


def test_take_turns_async_awaits_each_turn_before_the_next() -> None:
    order = []

    async def run(k: int, leg: int) -> int:
        await asyncio.sleep(0)
        order.append(leg)
        return 10 * k + leg

    results, _ = asyncio.run(take_turns_async([1, 2], 2, run))
    assert order == [1, 2, 2, 1] and results == {1: [1, 11], 2: [2, 12]}

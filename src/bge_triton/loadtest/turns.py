"""THE alternating-turns helper of every side-by-side measurement (one in flight, quiet hours, saturation rounds, raw
against stack, graph variants): the legs take turns in ABBA order (A B, then B A, ...), so a shared machine's drift
over minutes falls on every leg alike, and each leg's results (and a meter, e.g. a CPU clock, read around its own
turns only) are accumulated per leg. Stdlib only."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
Meter = Callable[[], float]


def abba(legs: Sequence[K], rounds: int) -> Iterator[tuple[int, K]]:
    """(round, leg) in turn order: the legs as given in even rounds, reversed in odd ones."""
    for k in range(rounds):
        yield from ((k, leg) for leg in (legs if k % 2 == 0 else legs[::-1]))


def blocks(items: Sequence[R], block: int) -> list[Sequence[R]]:
    """`items` cut into consecutive blocks of `block` (the last one shorter): block k is every leg's round k."""
    return [items[start:start + block] for start in range(0, len(items), max(1, block))]


def take_turns(legs: Sequence[K], rounds: int, run: Callable[[int, K], R], meter: Meter | None = None
               ) -> tuple[dict[K, list[R]], dict[K, float]]:
    """run(round, leg) for every round and leg in ABBA order: each leg's results in round order, and meter()
    summed over each leg's own turns (0.0 without a meter)."""
    results: dict[K, list[R]] = {leg: [] for leg in legs}
    used = dict.fromkeys(legs, 0.0)
    for k, leg in abba(legs, rounds):
        m0 = meter() if meter else 0.0
        results[leg].append(run(k, leg))
        used[leg] += (meter() - m0) if meter else 0.0
    return results, used


async def take_turns_async(legs: Sequence[K], rounds: int, run: Callable[[int, K], Awaitable[R]],
                           meter: Meter | None = None) -> tuple[dict[K, list[R]], dict[K, float]]:
    """take_turns with a coroutine function: each turn awaited before the next begins."""
    results: dict[K, list[R]] = {leg: [] for leg in legs}
    used = dict.fromkeys(legs, 0.0)
    for k, leg in abba(legs, rounds):
        m0 = meter() if meter else 0.0
        results[leg].append(await run(k, leg))
        used[leg] += (meter() - m0) if meter else 0.0
    return results, used

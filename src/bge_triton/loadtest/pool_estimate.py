"""What the text endpoint's scheduler can reach on a length mix: a closed loop priced by the cost model.

`users` one-text callers, each sending its next text (drawn from `lengths`, seeded) when the last one
returns; `instances` pools (Triton hands each request to one instance); the emulated GPU runs one
sub-batch at a time, each chosen by the shipped policy (text_scheduler.choose) from one pool. No server,
no threads: the ceiling the scheduler's policy and the traffic leave, beside the measured rows.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bge_triton.loadtest.costmodel import CostModel


@dataclass
class _Item:  # what choose() reads of a pooled text
    padded: int
    arrival: float


def closed_loop_rate(lengths: Sequence[int], users: int, cost: CostModel, choose: Callable, *, instances: int = 1,
                     budget: int = 8192, max_batch: int = 64, multiple: int = 8, overhead_tokens: int = 628,
                     texts: int = 20000, seed: int = 0) -> float:
    """Texts/s of the emulated GPU in steady state (the first `users` texts are not counted)."""
    if users < 1 or instances < 1:
        raise ValueError(f"users={users}, instances={instances}: both must be >= 1")
    rng = random.Random(seed)
    pad = lambda n: -(-n // multiple) * multiple  # noqa: E731
    pools: list[list[_Item]] = [[] for _ in range(instances)]
    for u in range(users):
        pools[u % instances].append(_Item(pad(rng.choice(lengths)), 0.0))
    now_ms = counted_ms = 0.0
    done = counted = turn = 0
    while counted < texts:
        pool = pools[turn % instances]
        turn += 1
        if not pool:
            continue
        run = choose(pool, budget, max_batch, overhead_tokens)
        taken = set(map(id, run))
        pools[(turn - 1) % instances] = [it for it in pool if id(it) not in taken]
        ms = cost.batch_ms(len(run), max(it.padded for it in run))
        now_ms += ms
        done += len(run)
        if done > users:  # past the start: every user has been answered once
            counted_ms += ms
            counted += len(run)
        for _ in run:  # each answered user sends its next text to a random instance
            pools[rng.randrange(instances)].append(_Item(pad(rng.choice(lengths)), now_ms / 1000.0))
    return 1000.0 * counted / counted_ms

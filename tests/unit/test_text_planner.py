"""The text endpoint's length-aware sub-batch planner (text_stages.plan_sub_batches, no Triton)."""
from __future__ import annotations

import random

import pytest

from bge_triton.repository import endpoint_modules


@pytest.fixture(scope="module")
def planner():
    return endpoint_modules()[1].plan_sub_batches  # text_stages


def _check(plans, lengths, budget, max_batch, multiple):
    seen = sorted(i for rows, _ in plans for i in rows)
    assert seen == list(range(len(lengths)))  # every text exactly once
    for rows, pad in plans:
        assert pad % multiple == 0 and pad >= max(lengths[i] for i in rows)
        assert len(rows) <= max_batch
        assert len(rows) == 1 or len(rows) * pad <= budget


def test_mixed_lengths_low_padding(planner) -> None:
    rng = random.Random(0)
    lengths = [rng.choice([5, 9, 12, 40, 80, 81, 120, 200, 300]) for _ in range(128)]
    plans = planner(lengths, 8192, 64, 8)
    _check(plans, lengths, 8192, 64, 8)
    padded = sum(len(rows) * pad for rows, pad in plans)
    assert padded / sum(lengths) <= 1.15
    fifo = max(lengths) * len(lengths)  # pad-to-longest, one batch
    assert padded < fifo / 2


def test_budget_and_max_batch_hold(planner) -> None:
    lengths = [64] * 200
    plans = planner(lengths, 1024, 64, 8)
    _check(plans, lengths, 1024, 64, 8)
    assert all(len(rows) == 16 for rows, _ in plans[:-1])


def test_text_longer_than_budget_gets_its_own_sub_batch(planner) -> None:
    lengths = [512, 10, 10]
    plans = planner(lengths, 256, 64, 8)
    _check(plans, lengths, 256, 64, 8)
    assert ([0], 512) in [(list(r), p) for r, p in plans]


def test_equal_lengths_stay_together(planner) -> None:
    plans = planner([32] * 10, 8192, 64, 8)
    assert len(plans) == 1 and plans[0][1] == 32

"""loadtest.targets.closed_loop_rate: the closed loop that prices the shipped scheduler policy."""
from __future__ import annotations

import pytest

from bge_triton.loadtest.costmodel import CostModel
from bge_triton.loadtest.targets import closed_loop_rate
from bge_triton.repository import endpoint_modules

choose = endpoint_modules()[2].choose  # text_scheduler's policy

COST = CostModel(6259.0, 9.96)
MIX = [12, 20, 33, 48, 48, 64, 71, 90, 130, 250]


def test_equal_lengths_reach_full_batches() -> None:
    rate = closed_loop_rate([64] * 10, 256, COST, choose, texts=4000)
    assert rate == pytest.approx(COST.capacity_qps(64, 64), rel=1e-6)  # every run: 64 texts of 64 tokens


def test_more_texts_in_one_pool_plan_better_and_two_pools_split_them() -> None:
    small, big = (closed_loop_rate(MIX, users, COST, choose, texts=6000) for users in (64, 512))
    split = closed_loop_rate(MIX, 512, COST, choose, instances=2, texts=6000)
    assert small < split < big


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="users=0"):
        closed_loop_rate(MIX, 0, COST, choose)

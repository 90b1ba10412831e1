"""The one load engine (loadtest.loops.drive): closed, open and shaped load over any async caller, each request
recorded once with its scheduled send time; both of its callers (raw HTTP, tritonclient) go through it."""
from __future__ import annotations

import ast
import asyncio
import random
from pathlib import Path

import pytest

from bge_triton.loadtest import loops
from bge_triton.loadtest.loops import Load, drive

SRC = Path(__file__).resolve().parents[2] / "src/bge_triton/loadtest"


def run_drive(call, load: Load, window_s: float, **kw) -> tuple[int, list[tuple[float, float, str]], float]:
    records: list[tuple[float, float, str]] = []

    async def main() -> tuple[int, float]:
        now = asyncio.get_running_loop().time
        t0 = now()
        sent = await drive(call, load, now, t0, t0 + window_s, lambda s, d, k, _e: records.append((s, d, k)), start=t0,
                           **kw)
        return sent, t0

    sent, t0 = asyncio.run(main())
    return sent, records, t0


def test_closed_users_send_back_to_back_each_request_recorded_once() -> None:
    seen: list[int] = []

    async def call(i: int) -> None:
        seen.append(i)
        await asyncio.sleep(0.001)
        if i == 3:
            raise RuntimeError("refused")

    sent, records, _ = run_drive(call, Load(users=3), 0.05)
    assert sorted(seen) == list(range(len(seen))) and sent == len(seen) == len(records) > 3
    assert [k for *_, k in records].count("raw:RuntimeError") == 1 and all(s <= d for s, d, _ in records)


def test_a_request_unanswered_after_the_grace_is_lost_and_the_engine_returns() -> None:
    async def call(i: int) -> None:
        await (asyncio.Event().wait() if i == 0 else asyncio.sleep(0.001))

    for load in (Load(users=2), Load(rate=400.0)):
        sent, records, _ = run_drive(call, load, 0.05, grace_s=0.02)
        assert [k for *_, k in records].count("lost") == 1 and len(records) == sent, load


def test_open_loop_latency_counts_from_the_poisson_schedule() -> None:
    """The recorded send times are the schedule (seeded Poisson gaps), not when a slow caller got to send."""
    async def slow(_i: int) -> None:
        await asyncio.sleep(0.01)

    sent, records, t0 = run_drive(slow, Load(rate=300.0), 0.1, seed=3)
    rng, t, expected = random.Random(3), t0, []
    while (t := t + rng.expovariate(300.0)) < t0 + 0.1:
        expected.append(t)
    assert sorted(s for s, _, _ in records) == pytest.approx(expected) and sent == len(expected)


def test_shaped_rate_follows_the_shape_curve() -> None:
    assert Load(rate=100.0).rate_at(0.3) == 100.0
    assert Load(rate=100.0, shape="tidal").rate_at(0.0) == pytest.approx(20.0)
    assert Load(rate=100.0, shape="tidal").rate_at(0.5) == pytest.approx(100.0)
    assert Load(rate=100.0, shape="spike").rate_at(0.55) == 100.0 and Load(users=4).label == "C=4"


def test_until_holds_the_load_past_the_window() -> None:
    """engine.measure's `side` (a reload) keeps the load on until it returns: drive stops at until(), not at end."""
    held = {"n": 0}

    def until(_t: float) -> bool:
        held["n"] += 1
        return held["n"] > 40

    async def call(_i: int) -> None:
        await asyncio.sleep(0)

    sent, _, _ = run_drive(call, Load(users=1), 0.0, until=until)
    assert sent == 40


def test_the_callers_drive_the_one_engine_and_keep_no_loop_of_their_own() -> None:
    for name in ("loadgen.py", "engine.py"):
        tree = ast.parse((SRC / name).read_text(encoding="utf-8"))
        called = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
                  for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert "drive" in called and not called & {"poisson", "open_loop", "closed_loop", "expovariate"}, name
    assert loops.drive is drive

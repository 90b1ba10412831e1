"""Unit tests of the retry policy and of the one place that maps transport errors to the kit's tree."""
from __future__ import annotations

import asyncio
import random

import pytest
from tritonclient.utils import InferenceServerException

from bge_triton.client.errors import (
    InputError,
    KitError,
    ModelConfigError,
    Overloaded,
    ServerUnavailable,
    Timeout,
    classify,
    is_retryable,
)
from bge_triton.client.retry import RetryPolicy, acall_with_retry, call_with_retry


@pytest.mark.parametrize("status, msg, cls, retry", [
    ("StatusCode.UNAVAILABLE", "Exceeds maximum queue size", Overloaded, True),
    ("503", "Exceeds maximum queue size", Overloaded, True),
    ("StatusCode.UNAVAILABLE", "Request timeout expired", Overloaded, True),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", ServerUnavailable, True),
    ("StatusCode.INVALID_ARGUMENT", "text has 900 tokens, limit 512", InputError, False),
    ("400", "unexpected shape for input 'text'", InputError, False),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'x' is not found", ModelConfigError, False),
    ("400", "Request for unknown model: 'x' is not found", ModelConfigError, False),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", Timeout, False),
    ("StatusCode.INTERNAL", "python model crashed", KitError, False),
])
def test_classify_triton_errors(status: str, msg: str, cls: type, retry: bool) -> None:
    err = classify(InferenceServerException(msg, status=status), "infer", 1.0)
    assert type(err) is cls
    assert is_retryable(err) is retry
    assert msg in str(err) or "timeout_s=1.0" in str(err)


@pytest.mark.parametrize("exc, cls, retry", [
    (ConnectionRefusedError(111, "refused"), ServerUnavailable, True),
    (ConnectionResetError(104, "reset"), ServerUnavailable, True),
    (asyncio.TimeoutError(), Timeout, False),
    (TimeoutError(), Timeout, False),
    (ValueError("odd"), KitError, False),
])
def test_classify_python_errors(exc: BaseException, cls: type, retry: bool) -> None:
    err = classify(exc)
    assert type(err) is cls and is_retryable(err) is retry


def test_classify_gevent_timeout_and_passthrough() -> None:
    import gevent

    assert type(classify(gevent.Timeout(1))) is Timeout and is_retryable(classify(gevent.Timeout(1))) is False
    mine = InputError("x")
    assert classify(mine) is mine


def test_backoff_is_full_jitter_and_capped() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.5)
    rng = random.Random(0)
    for k, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.5), (10, 0.5)]:
        values = [policy.backoff(k, rng) for _ in range(200)]
        assert 0 <= min(values) and max(values) <= cap
        assert max(values) > cap * 0.8  # full jitter spreads over [0, cap]


def test_next_delay_rules() -> None:
    policy = RetryPolicy(max_attempts=3, total_s=1.0, initial_backoff_s=0.1)
    assert policy.next_delay(Overloaded("q"), 1, 0.0) is not None
    assert policy.next_delay(Overloaded("q"), 3, 0.0) is None  # attempts used up
    assert policy.next_delay(InputError("bad"), 1, 0.0) is None  # never retried
    assert policy.next_delay(ModelConfigError("cfg"), 1, 0.0) is None
    assert policy.next_delay(Overloaded("q"), 1, 0.999) is None  # total budget
    assert RetryPolicy.off().next_delay(Overloaded("q"), 1, 0.0) is None
    assert policy.attempt_timeout(10.0, 0.25) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_call_with_retry_retries_overload_then_succeeds() -> None:
    clock, calls = FakeClock(), []

    def fn(timeout: float) -> str:
        calls.append(timeout)
        if len(calls) < 3:
            raise InferenceServerException("Exceeds maximum queue size", status="StatusCode.UNAVAILABLE")
        return "ok"

    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.1)
    assert call_with_retry(fn, policy, 2.0, "infer", clock=clock, sleep=clock.sleep) == "ok"
    assert len(calls) == 3 and len(clock.sleeps) == 2 and all(t <= 2.0 for t in calls)


def test_call_with_retry_never_retries_input_errors() -> None:
    clock, calls = FakeClock(), []

    def fn(timeout: float) -> None:
        calls.append(timeout)
        raise InferenceServerException("too long", status="StatusCode.INVALID_ARGUMENT")

    with pytest.raises(InputError, match="too long"):
        call_with_retry(fn, RetryPolicy(), 1.0, "infer", clock=clock, sleep=clock.sleep)
    assert len(calls) == 1 and clock.sleeps == []


def test_call_with_retry_total_time_is_bounded() -> None:
    clock = FakeClock()

    def fn(timeout: float) -> None:
        clock.now += timeout  # every attempt uses its whole allowance, then fails
        raise ConnectionRefusedError(111, "refused")

    policy = RetryPolicy(max_attempts=100, initial_backoff_s=0.5, max_backoff_s=1.0, total_s=5.0)
    with pytest.raises(ServerUnavailable, match="gave up after"):
        call_with_retry(fn, policy, 2.0, "infer", clock=clock, sleep=clock.sleep)
    assert clock.now <= 5.0 + 1e-9


def test_acall_with_retry() -> None:
    calls: list[float] = []

    async def fn(timeout: float) -> str:
        calls.append(timeout)
        if len(calls) == 1:
            raise InferenceServerException("Request timeout expired", status="503")
        return "ok"

    policy = RetryPolicy(initial_backoff_s=0.001)
    assert asyncio.run(acall_with_retry(fn, policy, 1.0, "infer")) == "ok"
    assert len(calls) == 2


def test_acall_with_retry_does_not_retry_cancellation() -> None:
    calls: list[float] = []

    async def fn(timeout: float) -> None:
        calls.append(timeout)
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(acall_with_retry(fn, RetryPolicy(), 1.0, "infer"))
    assert len(calls) == 1


def test_retry_budget_stops_amplifying_a_sustained_overload() -> None:
    """Under a storm where every attempt is rejected, the budget caps total attempts far below
    max_attempts x requests; successes refill it so retries resume once the server recovers."""
    from bge_triton.client.errors import Overloaded
    from bge_triton.client.retry import RetryBudget, RetryPolicy, call_with_retry

    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.0, total_s=60.0)
    budget = RetryBudget(max_tokens=10, token_ratio=0.1)
    attempts = 0

    def rejected(_timeout: float) -> None:
        nonlocal attempts
        attempts += 1
        raise Overloaded("Exceeds maximum queue size")

    for _ in range(100):
        with pytest.raises(Overloaded):
            call_with_retry(rejected, policy, 1.0, "t", sleep=lambda s: None, budget=budget)
    assert attempts < 100 + 10, attempts  # without the budget: 400 attempts
    assert not budget.allows_retry()
    for _ in range(60):
        call_with_retry(lambda t: 1, policy, 1.0, "t", sleep=lambda s: None, budget=budget)
    assert budget.allows_retry()  # healthy traffic restores retries

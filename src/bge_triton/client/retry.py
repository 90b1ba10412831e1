"""Retry policy: exponential backoff with full jitter, bounded attempts and a bounded total time.

The policy is pure (delays come from an injectable RNG and clock); `call_with_retry` and
`acall_with_retry` are the two thin loops that sleep between attempts.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

from bge_triton.client.errors import KitError, classify, is_retryable

__all__ = ["RetryPolicy", "RetryBudget", "call_with_retry", "acall_with_retry"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """max_attempts tries in all; sleep U(0, min(max_backoff_s, initial_backoff_s * 2**k)) between
    them (AWS "full jitter"); never start an attempt after total_s has passed."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    total_s: float = 30.0
    budget_tokens: float = 10.0  # client-wide RetryBudget (0 = no budget: every call may use max_attempts)
    budget_ratio: float = 0.1

    def make_budget(self) -> RetryBudget | None:
        """The client-wide retry throttle this policy asks for (None when budget_tokens is 0)."""
        return RetryBudget(self.budget_tokens, self.budget_ratio) if self.budget_tokens > 0 else None

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.total_s <= 0:
            raise ValueError(f"bad RetryPolicy {self}: need max_attempts >= 1, backoffs >= 0, total_s > 0")

    @classmethod
    def off(cls) -> RetryPolicy:
        """One attempt, no retry."""
        return cls(max_attempts=1)

    def backoff(self, retry_index: int, rng: random.Random | None = None) -> float:
        """Delay before retry number retry_index (0-based): full jitter over the capped exponential."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * (2 ** retry_index))
        return (rng or random).uniform(0.0, cap)

    def next_delay(self, err: BaseException, attempt: int, elapsed_s: float,
                   rng: random.Random | None = None) -> float | None:
        """Seconds to wait before the next attempt, or None to give up (attempt is 1-based)."""
        if not is_retryable(err) or attempt >= self.max_attempts:
            return None
        delay = self.backoff(attempt - 1, rng)
        if elapsed_s + delay >= self.total_s:
            return None
        return delay

    def attempt_timeout(self, timeout_s: float, elapsed_s: float) -> float:
        """Per-attempt timeout, shortened so the last attempt ends by total_s."""
        return max(0.001, min(timeout_s, self.total_s - elapsed_s))


class RetryBudget:
    """Client-wide retry throttle (gRPC's retryThrottling): retries stop while failures dominate.

    Tokens start at max_tokens; a retryable failure costs 1, a success earns token_ratio. A retry
    is allowed only while tokens > max_tokens / 2, so in a sustained overload the client adds at
    most about token_ratio extra attempts per success instead of multiplying the storm.
    """

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        if max_tokens <= 0 or token_ratio <= 0:
            raise ValueError(f"bad RetryBudget(max_tokens={max_tokens}, token_ratio={token_ratio}): both must be > 0")
        self.max_tokens, self.token_ratio = float(max_tokens), float(token_ratio)
        self.tokens = self.max_tokens

    def on_success(self) -> None:
        self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)

    def on_failure(self) -> None:
        self.tokens = max(0.0, self.tokens - 1.0)

    def allows_retry(self) -> bool:
        return self.tokens > self.max_tokens / 2


def _give_up(err: KitError, attempt: int, exc: BaseException, throttled: bool) -> NoReturn:
    if attempt > 1 or throttled:
        why = "retry budget exhausted: the server is overloaded" if throttled else f"gave up after {attempt} attempts"
        err.args = (f"{err.args[0]} ({why})",) if err.args else err.args
    raise err from (None if err is exc else exc)


def _next_delay_or_raise(exc: BaseException, policy: RetryPolicy, attempt: int, elapsed_s: float,
                         budget: RetryBudget | None, where: str, timeout_s: float) -> float:
    """The one retry decision both loops share: classify, charge the budget, wait or give up."""
    err = classify(exc, where, timeout_s)
    delay = policy.next_delay(err, attempt, elapsed_s)
    throttled = False
    if budget is not None and is_retryable(err):
        budget.on_failure()
        throttled = delay is not None and not budget.allows_retry()
    if delay is None or throttled:
        _give_up(err, attempt, exc, throttled)
    return delay


def call_with_retry(fn: Callable[[float], T], policy: RetryPolicy, timeout_s: float, where: str,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep, budget: RetryBudget | None = None) -> T:
    """Call fn(per_attempt_timeout) until it succeeds or the policy gives up; raise a KitError."""
    start, attempt = clock(), 0
    while True:
        attempt += 1
        try:
            result = fn(policy.attempt_timeout(timeout_s, clock() - start))
        except BaseException as exc:  # classified and re-raised below
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            sleep(_next_delay_or_raise(exc, policy, attempt, clock() - start, budget, where, timeout_s))
        else:
            if budget is not None:
                budget.on_success()
            return result


async def acall_with_retry(fn: Callable[[float], Awaitable[T]], policy: RetryPolicy, timeout_s: float,
                           where: str, clock: Callable[[], float] = time.monotonic,
                           budget: RetryBudget | None = None) -> T:
    """Async twin of call_with_retry; cancellation propagates at once and is never retried."""
    start, attempt = clock(), 0
    while True:
        attempt += 1
        try:
            result = await fn(policy.attempt_timeout(timeout_s, clock() - start))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # classified and re-raised below
            await asyncio.sleep(_next_delay_or_raise(exc, policy, attempt, clock() - start, budget, where,
                                                     timeout_s))
        else:
            if budget is not None:
                budget.on_success()
            return result

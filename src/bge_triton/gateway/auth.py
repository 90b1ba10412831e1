"""API keys (`Authorization: Bearer <key>`) and a per-key request-rate limit (token bucket)."""
from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable

from bge_triton.gateway.errors import rate_limited, unauthorized

__all__ = ["TokenBucket", "KeyGuard"]


class TokenBucket:
    """`rate` requests/s sustained, `burst` at once; the clock is injectable for tests."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.tokens, self.stamp = float(burst), clock()

    def take(self) -> float:
        """0.0 if a request may go now (one token spent), else the seconds until one may."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class KeyGuard:
    """Checks the bearer key of each request (none configured: every request passes) and its rate."""

    def __init__(self, keys: frozenset[str], rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keys = tuple(sorted(keys))
        self.rate, self.burst, self.clock = rate, burst, clock
        self.buckets: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def _match(self, presented: str) -> str | None:
        """The configured key equal to `presented`, compared in constant time."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.encode(), presented.encode()):
                found = key
        return found

    def check(self, authorization: str | None) -> str | None:
        """The caller's key (None when no keys are configured); GatewayError 401 or 429 otherwise."""
        key: str | None
        if not self.keys:
            key = "anonymous"
        else:
            if not authorization:
                raise unauthorized("No API key: send the header `Authorization: Bearer <key>` "
                                   "(openai client: api_key=...)")
            scheme, _, token = authorization.partition(" ")
            key = self._match(token.strip()) if scheme.lower() == "bearer" else None
            if key is None:
                raise unauthorized("Incorrect API key: the `Authorization: Bearer` key is not one this "
                                   "gateway accepts (--api-key / --api-keys-file)")
        assert key is not None
        if self.rate > 0:
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self.buckets[key] = TokenBucket(self.rate, self.burst, self.clock)
            wait = bucket.take()
            if wait > 0:
                raise rate_limited(max(1, math.ceil(wait)), self.rate)
        return key if self.keys else None


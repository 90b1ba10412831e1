"""The kit's error tree as the client raises it, and the ONE place that maps transport errors onto it.

tritonclient (gRPC and HTTP), grpc, aiohttp, geventhttpclient and asyncio each fail in their own
way; `classify` turns every one of them into a KitError whose message says what to do, and
`is_retryable` says which of them the retry policy may repeat.
"""
from __future__ import annotations

import asyncio
import socket

from bge_triton.errors import InputError, KitError, ModelConfigError, Overloaded, ServerUnavailable
from tritonclient.utils import InferenceServerException

__all__ = ["KitError", "InputError", "ModelConfigError", "Overloaded", "ServerUnavailable",
           "classify", "is_retryable"]

_QUEUE_FULL = ("exceeds maximum queue size", "request timeout expired")
_UNKNOWN_MODEL = ("unknown model", "is not found", "is not ready", "no version is available")
_TIMEOUT = ("deadline exceeded", "timed out", "timeout")


def _timeout_error(where: str, timeout_s: float | None) -> ServerUnavailable:
    err = ServerUnavailable(f"{where}: no answer within timeout_s={timeout_s}; raise timeout_s, or lower the "
                            "load / batch size (the server may still be working on it, so it is not retried)")
    err.retryable = False  # type: ignore[attr-defined]
    return err


def _from_triton(exc: InferenceServerException, where: str, timeout_s: float | None) -> KitError:
    status = (exc.status() or "").upper()
    msg = exc.message() or str(exc)
    low = msg.lower()
    if any(s in low for s in _QUEUE_FULL):
        return Overloaded(f"{where}: server is overloaded ({msg}); it was retried with backoff - add "
                          "instances, raise max_queue_size / the queue timeout, or slow the callers")
    if "DEADLINE_EXCEEDED" in status or status == "504" or (not status and any(s in low for s in _TIMEOUT)):
        return _timeout_error(where, timeout_s)
    if any(s in low for s in _UNKNOWN_MODEL) or "NOT_FOUND" in status or status == "404":
        return ModelConfigError(f"{where}: {msg}. Check model= and that the repository is loaded "
                                "(`python -m bge_triton.client health`, `python -m bge_triton.server status`)")
    if "UNAVAILABLE" in status or status in ("502", "503"):
        return ServerUnavailable(f"{where}: server unavailable ({msg}); is tritonserver running at the url? "
                                 "(`python -m bge_triton.server up ...`)")
    if "INVALID_ARGUMENT" in status or status in ("400", "413", "422"):
        return InputError(f"{where}: the server rejected the input: {msg}. Fix the input (e.g. "
                          "truncate=True for over-long texts); invalid input is never retried")
    if "CANCELLED" in status:
        return ServerUnavailable(f"{where}: request cancelled ({msg})")
    if not status and ("connect" in low or "connection" in low):
        return ServerUnavailable(f"{where}: cannot connect ({msg}); start the server or fix url=")
    return KitError(f"{where}: server error [{status or 'client'}] {msg}; see the tritonserver log")


def classify(exc: BaseException, where: str = "request", timeout_s: float | None = None) -> KitError:
    """Map any transport exception to the kit's error tree; KitErrors pass through unchanged."""
    if isinstance(exc, KitError):
        return exc
    if isinstance(exc, InferenceServerException):
        return _from_triton(exc, where, timeout_s)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, socket.timeout)):
        return _timeout_error(where, timeout_s)
    try:  # gevent.Timeout is not an Exception subclass; imported lazily (HTTP sync only)
        import gevent

        if isinstance(exc, gevent.Timeout):
            return _timeout_error(where, timeout_s)
    except ImportError:  # pragma: no cover - gevent ships with tritonclient[http]
        pass
    try:  # the sync HTTP client's "server closed the connection mid-response"
        from geventhttpclient.response import HTTPConnectionClosed

        if isinstance(exc, HTTPConnectionClosed):
            return ServerUnavailable(f"{where}: the server closed the connection ({exc}); it may have "
                                     "restarted or crashed: check `python -m bge_triton.server status`")
    except ImportError:  # pragma: no cover - geventhttpclient ships with tritonclient[http]
        pass
    if isinstance(exc, (ConnectionError, OSError, EOFError)):
        return ServerUnavailable(f"{where}: connection failed ({type(exc).__name__}: {exc}); is tritonserver "
                                 "running at the url? (`python -m bge_triton.server up ...`)")
    try:
        import aiohttp

        if isinstance(exc, aiohttp.ClientConnectionError):
            return ServerUnavailable(f"{where}: connection failed ({type(exc).__name__}: {exc}); is "
                                     "tritonserver running at the url?")
        if isinstance(exc, aiohttp.ClientError):
            return KitError(f"{where}: HTTP client error {type(exc).__name__}: {exc}")
    except ImportError:  # pragma: no cover
        pass
    return KitError(f"{where}: unexpected {type(exc).__name__}: {exc}")


def is_retryable(err: BaseException) -> bool:
    """Overloaded and connection failures are retried; invalid input, config errors and timeouts never."""
    return isinstance(err, ServerUnavailable) and getattr(err, "retryable", True)

"""The kit's error tree as the client raises it, and the ONE place that maps transport errors onto it.

tritonclient (gRPC and HTTP), grpc, aiohttp, geventhttpclient and asyncio each fail in their own
way; `classify` turns every one of them into a KitError whose message says what to do, and
`is_retryable` says which of them the retry policy may repeat.
"""
from __future__ import annotations

import asyncio
import socket

from tritonclient.utils import InferenceServerException

from bge_triton.errors import InputError, KitError, ModelConfigError, Overloaded, ServerUnavailable, Timeout

__all__ = ["KitError", "InputError", "ModelConfigError", "Overloaded", "ServerUnavailable", "Timeout",
           "classify", "is_retryable", "status_code"]

_QUEUE_FULL = ("exceeds maximum queue size", "request timeout expired")
_UNKNOWN_MODEL = ("unknown model", "is not found", "is not ready", "no version is available")
_TIMEOUT = ("deadline exceeded", "timed out", "timeout")
# HTTP statuses as the gRPC code Triton answers with (Triton maps its codes to HTTP this way).
_HTTP = {"400": "INVALID_ARGUMENT", "404": "NOT_FOUND", "413": "INVALID_ARGUMENT", "422": "INVALID_ARGUMENT",
         "429": "RESOURCE_EXHAUSTED", "499": "CANCELLED", "500": "INTERNAL", "501": "UNIMPLEMENTED",
         "502": "UNAVAILABLE", "503": "UNAVAILABLE", "504": "DEADLINE_EXCEEDED"}


def status_code(exc: InferenceServerException) -> str | None:
    """The error's status as a gRPC code name ("UNAVAILABLE", ...), from gRPC or HTTP; None if it has none."""
    status = str(exc.status() or "").strip().upper()
    if not status:
        return None
    status = status.rpartition(".")[2]  # "StatusCode.UNAVAILABLE" -> "UNAVAILABLE"
    return _HTTP.get(status, status)


def _timeout_error(where: str, timeout_s: float | None) -> Timeout:
    return Timeout(f"{where}: no answer within timeout_s={timeout_s}; raise timeout_s, or lower the "
                   "load / batch size (the server may still be working on it, so it is not retried)")


def _overloaded(where: str, msg: str) -> Overloaded:
    return Overloaded(f"{where}: server is overloaded ({msg}); it was retried with backoff - add "
                      "instances, raise max_queue_size / the queue timeout, or slow the callers")


def _unknown_model(where: str, msg: str) -> ModelConfigError:
    return ModelConfigError(f"{where}: {msg}. Check model= and that the repository is loaded "
                            "(`bge-triton health --url ...`; a local server: `bge-triton serve status`)")


def _from_triton(exc: InferenceServerException, where: str, timeout_s: float | None) -> KitError:
    """By status code first; the message only refines a code (UNAVAILABLE: overload or down) or stands in
    for a code that says nothing (none, UNKNOWN, INTERNAL: e.g. a server that lost the encoder's code)."""
    code = status_code(exc)
    msg = exc.message() or str(exc)
    low = msg.lower()
    queue_full = any(s in low for s in _QUEUE_FULL)
    if code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
        if queue_full or code == "RESOURCE_EXHAUSTED":
            return _overloaded(where, msg)
        if any(s in low for s in _UNKNOWN_MODEL):
            return _unknown_model(where, msg)
        return ServerUnavailable(f"{where}: server unavailable ({msg}); is tritonserver running at the url? "
                                 "(`bge-triton serve up ...`)")
    if code == "INVALID_ARGUMENT":
        if any(s in low for s in _UNKNOWN_MODEL):  # Triton's HTTP answers an unknown model with 400
            return _unknown_model(where, msg)
        return InputError(f"{where}: the server rejected the input: {msg}. Fix the input (e.g. "
                          "truncate=True for over-long texts); invalid input is never retried")
    if code == "NOT_FOUND":
        return _unknown_model(where, msg)
    if code == "DEADLINE_EXCEEDED":
        return _timeout_error(where, timeout_s)
    if code == "CANCELLED":
        return ServerUnavailable(f"{where}: request cancelled ({msg})")
    if code in (None, "UNKNOWN", "INTERNAL"):  # the code says nothing: the message is all there is
        if queue_full:
            return _overloaded(where, msg)
        if code is None and any(s in low for s in _TIMEOUT):
            return _timeout_error(where, timeout_s)
        if any(s in low for s in _UNKNOWN_MODEL):
            return _unknown_model(where, msg)
        if code is None and ("connect" in low or "connection" in low):
            return ServerUnavailable(f"{where}: cannot connect ({msg}); start the server or fix url=")
    return KitError(f"{where}: server error [{code or 'client'}] {msg}; see the tritonserver log")


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
                                     "restarted or crashed: check the server's log (a local server: "
                                     "`bge-triton serve status`)")
    except ImportError:  # pragma: no cover - geventhttpclient ships with tritonclient[http]
        pass
    if isinstance(exc, (ConnectionError, OSError, EOFError)):
        return ServerUnavailable(f"{where}: connection failed ({type(exc).__name__}: {exc}); is tritonserver "
                                 "running at the url? (`bge-triton serve up ...`)")
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

"""One small exception tree for the whole kit; every message says what was wrong and what to do.

KitError
 +-- ExportError, ModelConfigError, ServerNotReady, InputError
 +-- ServerUnavailable (retryable unless the instance says otherwise)
      +-- Overloaded (UNAVAILABLE / 503 / 429: queue full or queue timeout)
      +-- Timeout (the caller's deadline passed: never retried)
"""
from __future__ import annotations


class KitError(Exception):
    """Base of every error the kit raises on purpose."""


class ExportError(KitError):
    """The exporter could not produce a valid model (load, convert, fuse, quantise or validate)."""


class ModelConfigError(KitError):
    """A config.pbtxt is malformed, or the server's model config does not match what the caller expects."""


class ServerNotReady(KitError):
    """The local tritonserver did not start or did not become ready (message carries the log tail)."""


class PortInUse(ServerNotReady):
    """A port picked for a local tritonserver was bound by another process before the server could bind it."""


class ServerUnavailable(KitError):
    """The server cannot be reached (connection refused, reset, or it went away mid-request)."""


class Timeout(ServerUnavailable):
    """No answer within the caller's deadline (timeout_s). The server may still be working on the request,
    so it is never retried; raise timeout_s or lower the load. A ServerUnavailable for code that catches those."""

    retryable = False


class Overloaded(ServerUnavailable):
    """The server answered UNAVAILABLE / 503: its queue is full or a queued request timed out."""


class InputError(KitError):
    """The request itself is invalid (empty text, too long with truncate=false, wrong dtype...). Never retried."""


# A bare status (gRPC code name or HTTP status) -> the error the kit raises for it, before the message refines it
# (client/errors.py: an UNAVAILABLE is Overloaded when its message says the queue was full).
_STATUS_KINDS = {"OK": "ok", "200": "ok", "INVALID_ARGUMENT": "InputError", "400": "InputError", "413": "InputError",
                 "422": "InputError", "NOT_FOUND": "ModelConfigError", "404": "ModelConfigError",
                 "RESOURCE_EXHAUSTED": "Overloaded", "429": "Overloaded", "UNAVAILABLE": "ServerUnavailable",
                 "502": "ServerUnavailable", "503": "ServerUnavailable", "CANCELLED": "ServerUnavailable",
                 "499": "ServerUnavailable", "DEADLINE_EXCEEDED": "Timeout", "504": "Timeout"}


def kind_of(exc_or_status: BaseException | object | None) -> str:
    """THE label of an outcome in reports: "ok" for None (or an OK status); for an exception the name of the most
    specific class of this tree it is (Overloaded, Timeout, ServerUnavailable, InputError, ...), "raw:<type>" for
    one outside the tree; for a status (grpc.StatusCode, "StatusCode.UNAVAILABLE", 503) the error it stands for."""
    if exc_or_status is None:
        return "ok"
    if isinstance(exc_or_status, BaseException):
        mine = next((c for c in type(exc_or_status).__mro__ if c.__module__ == __name__), None)
        return mine.__name__ if mine is not None else f"raw:{type(exc_or_status).__name__}"
    code = str(exc_or_status).strip().upper().rpartition(".")[2]
    return "ok" if not code else _STATUS_KINDS.get(code, "KitError")

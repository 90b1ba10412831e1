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

"""One small exception tree for the whole kit; every message says what was wrong and what to do."""
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


class Overloaded(ServerUnavailable):
    """The server answered UNAVAILABLE / 503: its queue is full or a queued request timed out."""


class InputError(KitError):
    """The request itself is invalid (empty text, too long with truncate=false, wrong dtype...). Never retried."""

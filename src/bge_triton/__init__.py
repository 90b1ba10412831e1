"""Shared pieces of bge-triton-kit: the exception tree and small helpers used by every stage."""
from bge_triton.errors import (
    ExportError,
    InputError,
    KitError,
    ModelConfigError,
    Overloaded,
    ServerNotReady,
    ServerUnavailable,
    Timeout,
)

__all__ = [
    "KitError",
    "ExportError",
    "ModelConfigError",
    "ServerNotReady",
    "ServerUnavailable",
    "Overloaded",
    "Timeout",
    "InputError",
]

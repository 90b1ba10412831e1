"""The text endpoint's settings, error kinds and encoder interface (standard library only).

Ships beside model.py; bge_triton/repository.py loads it to read and write the settings
through config.pbtxt, so the defaults below are the only ones in the kit.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

__all__ = ["TextSettings", "TextError", "BadInput", "TooLong", "EncoderOverloaded", "EncoderFailed",
           "TokenizerFailed", "Cancelled", "TRITON_CODES", "triton_code", "encoder_error",
           "EncoderBackend", "truthy"]


def truthy(value: object) -> bool:
    """A config or request flag: bools as they are; "false", "0", "no", "off" (any case) are False."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() not in ("false", "0", "no", "off")


@dataclass(frozen=True)
class TextSettings:
    """The text endpoint's config `parameters` (string values in config.pbtxt), typed, with defaults."""

    onnx_model: str = ""  # the encoder model reached through BLS; "" = <this model's name>_onnx
    tokenizer_dir: str = "tokenizer"  # holds tokenizer.json, relative to the version directory
    max_length: int = 512  # tokens per text, [CLS] and [SEP] included
    token_budget: int = 8192  # B x padded L of one encoder sub-batch (a longer lone text still runs)
    sub_batch_max: int = 64  # texts per sub-batch: at most the encoder's max_batch_size
    pad_to_multiple: int = 8  # sub-batches are padded to a multiple of this
    split_overhead_tokens: int = 64  # the planner's fixed cost of one encoder call, in tokens (a / b)
    # Dispatcher threads per instance = sub-batches at the encoder at once from this instance. 2 keeps the
    # encoder busy (one runs, one waits) without letting its batcher merge sub-batches past the token budget.
    max_in_flight: int = 2
    query_levels: int = 1  # priority levels 1..query_levels are queries: served first, never held
    query_window_s: float = 1.0  # query mode lasts this long after the last query (any instance)
    # In query mode bulk sub-batches are capped at this many tokens, one at a time across the instances,
    # so a query waits behind at most one short bulk sub-batch (the GPU does not preempt).
    query_token_budget: int = 512
    encoder: str = "bls"  # "bls", or X: the backend module encoder_X.py beside model.py (CPU variant)
    metrics_flush_s: float = 0.25  # counters are sent to the server at most this often
    # Every cancel_check_s the reaper expires deadlines and asks whether up to 16 waiting requests were cancelled
    # by their clients (each ask a GIL-holding round trip to the server: at most 2% of its time); 0 = never ask.
    cancel_check_s: float = 0.05
    age_bound_s: float = 0.0  # pool: a run is planned only from texts that arrived within this many seconds of
    # the oldest one waiting at its level (a long text is never overtaken by one that arrived later); 0 = off

    def __post_init__(self) -> None:
        for name in ("max_length", "token_budget", "sub_batch_max", "pad_to_multiple", "max_in_flight",
                     "query_token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter {name}={getattr(self, name)}: must be >= 1")
        for name in ("split_overhead_tokens", "metrics_flush_s", "query_levels", "query_window_s", "cancel_check_s",
                     "age_bound_s"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"parameter {name}={getattr(self, name)}: must be >= 0")
        if not self.encoder.strip():
            raise ValueError("parameter encoder is empty: use 'bls' (the default)")

    @classmethod
    def from_params(cls, params: Mapping[str, str], model_name: str = "") -> TextSettings:
        """Build from a config's string parameters; keys that are not settings are ignored."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in params:
                continue
            raw = str(params[f.name]).strip()
            kind: Any = type(f.default)
            try:
                values[f.name] = kind(raw) if kind is not str else raw
            except ValueError:
                raise ValueError(f"parameter {f.name}={raw!r}: not a valid {kind.__name__}; fix it in "
                                 "config.pbtxt") from None
        settings = cls(**values)
        if not settings.onnx_model and model_name:
            settings = dataclasses.replace(settings, onnx_model=f"{model_name}_onnx")
        return settings

    def to_params(self) -> dict[str, str]:
        """The string parameters to write into config.pbtxt (every setting, explicit)."""
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The parameter names that are settings."""
        return tuple(f.name for f in dataclasses.fields(cls))


class TextError(Exception):
    """An error of one request of the text endpoint; `kind` selects its status code (TRITON_CODES)."""

    kind = "encoder_failed"

    @property
    def message(self) -> str:
        return str(self)


class BadInput(TextError):
    """The request's text cannot be embedded (not UTF-8, NUL byte, empty)."""

    kind = "bad_input"


class TooLong(TextError):
    """A text over max_length tokens with truncate=false."""

    kind = "too_long"


class EncoderOverloaded(TextError):
    """The encoder's queue is full or its queue timeout expired: retry later."""

    kind = "overloaded"


class EncoderFailed(TextError):
    """The encoder answered any other error."""

    kind = "encoder_failed"


class TokenizerFailed(TextError):
    """The tokenizer raised on a request (a bug or a broken tokenizer.json, not the caller's input)."""

    kind = "internal"


class Cancelled(TextError):
    """The client cancelled the request (or its deadline passed at the client): its waiting texts are dropped."""

    kind = "cancelled"


# The ONE map from the core's error kinds to Triton error codes (names of pb_utils.TritonError's
# codes; Triton answers INVALID_ARG as gRPC INVALID_ARGUMENT / HTTP 400, UNAVAILABLE as gRPC
# UNAVAILABLE / HTTP 503, INTERNAL as gRPC INTERNAL / HTTP 500).
TRITON_CODES = {"bad_input": "INVALID_ARG", "too_long": "INVALID_ARG", "overloaded": "UNAVAILABLE",
                "encoder_failed": "INTERNAL", "internal": "INTERNAL", "cancelled": "CANCELLED"}


def triton_code(error: TextError) -> str:
    """The Triton error code (a pb_utils.TritonError attribute name) that answers `error`."""
    return TRITON_CODES[error.kind]


# Triton's own messages for a full queue and a queue timeout (UNAVAILABLE). python_backend r24.10
# (Triton 2.51) drops the code of a BLS response error: src/request_executor.cc builds every
# PbError from the message alone, so code() reads INTERNAL; the code is kept from r25.05 on
# (python_backend #398). The message is therefore the only sign of overload there. "Server is stopping"
# (src/request_executor.cc) and "Server not ready" (seen on a real 2.51 server: a BLS call after SIGTERM,
# tests/integration/test_text_endpoint_faults.py) are what a BLS call gets while the server shuts down:
# UNAVAILABLE too, so clients retry on another replica instead of reading a 500.
OVERLOAD_MESSAGES = ("Exceeds maximum queue size", "Request timeout expired", "Server is stopping",
                     "Server not ready")
STOPPING_MESSAGES = ("Server is stopping", "Server not ready")  # of those, the shutdown's: said so in the answer


def encoder_error(model: str, message: str, unavailable: bool = False) -> TextError:
    """The core's error for an encoder answer: overloaded (code UNAVAILABLE or its message) or failed."""
    if any(m in message for m in STOPPING_MESSAGES):
        return EncoderOverloaded(f"encoder {model} is unavailable, the server is shutting down: {message}; retry on "
                                 "another replica")
    if unavailable or any(m in message for m in OVERLOAD_MESSAGES):
        return EncoderOverloaded(f"encoder {model} is overloaded: {message}; retry with backoff, or add encoder "
                                 "instances / raise its max_queue_size or queue timeout")
    return EncoderFailed(f"encoder {model} failed: {message}")


class EncoderBackend:
    """What the run stage talks to: one padded sub-batch in, [B, dim] float32 embeddings out.

    run() blocks; the scheduler's max_in_flight dispatcher threads call it at once. Failures raise
    TextError (encoder_error). hold() is entered around each sub-batch (e.g. a lock on shared compute);
    close() is called at unload.
    """

    def run(self, ids: Any, mask: Any) -> Any:
        raise NotImplementedError

    def hold(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def close(self) -> None:
        return None

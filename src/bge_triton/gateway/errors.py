"""The gateway's errors and the ONE place that maps them (and the SDK's KitErrors) to HTTP answers.

Each error has a kind; KINDS gives its status on the OpenAI routes and on TEI's (TEI answers an over-long
input 413, a field it cannot deserialize 422 and overload 429; OpenAI says 400 and 503). Bodies: OpenAI's
{"error": {"message", "type", "param", "code"}}, TEI's {"error", "error_type"}. Messages speak the HTTP
API's words: the SDK's (a Triton address, `truncate=True`) never reach a client; they go to the log.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from bge_triton.errors import InputError, KitError, ModelConfigError, Overloaded, ServerUnavailable, Timeout

__all__ = ["GatewayError", "BadRequest", "KINDS", "bad_request", "too_large", "unknown_model", "unauthorized",
           "rate_limited", "overloaded", "from_kit_error", "openai_body", "tei_body"]

log = logging.getLogger("bge_triton.gateway")

# kind -> (OpenAI status, TEI status, OpenAI type, TEI error_type)
KINDS: dict[str, tuple[int, int, str, str]] = {
    "invalid_json": (400, 400, "invalid_request_error", "Validation"),
    "invalid": (400, 422, "invalid_request_error", "Validation"),
    "too_long": (400, 413, "invalid_request_error", "Validation"),
    "too_large": (413, 413, "invalid_request_error", "Validation"),
    "unauthorized": (401, 401, "invalid_request_error", "Unauthorized"),
    "not_found": (404, 404, "invalid_request_error", "Validation"),
    "method": (405, 405, "invalid_request_error", "Validation"),
    "rate_limited": (429, 429, "rate_limit_error", "Overloaded"),
    "overloaded": (503, 429, "server_error", "Overloaded"),
    "unavailable": (503, 503, "server_error", "Unhealthy"),
    "timeout": (504, 504, "server_error", "Backend"),
    "backend": (500, 424, "server_error", "Backend"),  # the model server failed it (TEI: 424 Failed Dependency)
    "internal": (500, 500, "server_error", "Backend"),  # the gateway itself failed it
}


class GatewayError(KitError):
    """One failed request: its kind (-> status per API), OpenAI code, the offending parameter, Retry-After."""

    kind = "internal"
    code = "internal_error"

    def __init__(self, message: str, *, kind: str | None = None, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param
        self.kind = kind or self.kind
        self.code = code or self.code
        self.retry_after_s = retry_after_s
        self._status = status  # a fixed status on every route (rare: TEI's own 422 for normalize)

    def status_for(self, tei: bool = False) -> int:
        openai, tei_status, _, _ = KINDS[self.kind]
        return self._status or (tei_status if tei else openai)

    @property
    def status(self) -> int:
        """The status on the OpenAI routes."""
        return self.status_for(False)

    @property
    def type(self) -> str:
        return KINDS[self.kind][2]

    @property
    def headers(self) -> dict[str, str]:
        """Retry-After for overload / unreachable answers; WWW-Authenticate for 401."""
        out = {}
        if self.retry_after_s is not None:
            out["retry-after"] = str(self.retry_after_s)
        if self.kind == "unauthorized":
            out["www-authenticate"] = 'Bearer realm="bge-triton gateway"'
        return out

    def fields(self) -> dict[str, Any]:
        """What rebuilds it in another process: GatewayError(**fields)."""
        return {"message": self.message, "kind": self.kind, "param": self.param, "code": self.code,
                "retry_after_s": self.retry_after_s, "status": self._status}


class BadRequest(GatewayError):
    """400 (OpenAI) / 422 (TEI): the request is malformed or asks for what this model cannot give."""

    kind = "invalid"
    code = "invalid_value"


def bad_request(message: str, *, param: str | None = None, code: str | None = None, tei: bool = False,
                status: int | None = None) -> GatewayError:
    """A BadRequest; code invalid_json answers 400 on both APIs."""
    return BadRequest(message, param=param, code=code, kind="invalid_json" if code == "invalid_json" else "invalid",
                      status=status if tei else None)


def too_large(message: str, param: str | None = None, code: str = "request_too_large", tei: bool = False
              ) -> GatewayError:
    """413: body bytes, inputs per request or characters per text above the configured limit."""
    return GatewayError(message, kind="too_large", param=param, code=code)


def unknown_model(name: Any, served: tuple[str, ...]) -> GatewayError:
    """404: `model` names nothing this gateway serves."""
    return GatewayError(f"The model {name!r} does not exist here; this gateway serves {', '.join(served)}. "
                        "Send one of those as `model` (GET /v1/models lists them).",
                        kind="not_found", param="model", code="model_not_found")


def unauthorized(message: str) -> GatewayError:
    """401: missing or unknown bearer key."""
    return GatewayError(message, kind="unauthorized", code="invalid_api_key")


def rate_limited(retry_after_s: int, rate: float) -> GatewayError:
    """429: this key sent more than its request-rate limit."""
    return GatewayError(f"Rate limit reached for this API key ({rate:g} requests/s); retry after "
                        f"{retry_after_s} s or ask for a higher --rate-limit.", kind="rate_limited",
                        code="rate_limit_exceeded", retry_after_s=retry_after_s)


def overloaded(message: str, retry_after_s: int) -> GatewayError:
    """503 (OpenAI) / 429 (TEI): the gateway's in-flight limit or Triton's queue is full."""
    return GatewayError(message, kind="overloaded", code="server_overloaded", retry_after_s=retry_after_s)


_TOO_LONG = re.compile(r"text (\d+) has (\d+) tokens, over the limit of (\d+)")
_REASON = re.compile(r"the server rejected the input: (.*?)\. Fix the input", re.S)


def from_kit_error(err: KitError, retry_after_s: int, tei: bool = False, rows: int = 1, query: bool = False,
                   max_batch: int = 0) -> GatewayError:
    """Map an SDK error to the gateway's answer in the API's words; the SDK's own text goes to the log only.
    rows / max_batch: the request's texts and the SDK's split (a text index from the endpoint is its chunk's)."""
    if isinstance(err, GatewayError):
        return err
    text = str(err)
    field = "inputs" if tei else "input"
    if isinstance(err, InputError):
        m = _TOO_LONG.search(text)
        if m:
            i, n, limit = (int(g) for g in m.groups())
            where = field if rows == 1 else f"{field}[{i}]" if rows <= max_batch else f"an item of `{field}`"
            where = where if where.startswith("an item") else f"`{where}`"
            return GatewayError(f"{where} has {n} tokens (with the model's special tokens"
                                f"{' and the query instruction' if query else ''}), the limit is {limit}: shorten "
                                f"it, or send {'truncate=true' if tei else 'truncate END or START'}",
                                kind="too_long", param=field, code="context_length_exceeded")
        m = _REASON.search(text)
        reason = m.group(1) if m else "the model refused the input"
        log.info("input refused by the text endpoint: %s", text)
        return BadRequest(f"`{field}`: {reason}", param=field)
    log.warning("backend error: %s", text)
    if isinstance(err, Overloaded):
        return overloaded("The model is overloaded (its queue is full); retry after the Retry-After seconds",
                          retry_after_s)
    if isinstance(err, Timeout):  # the SDK's deadline passed (a ServerUnavailable, so tested first)
        return GatewayError("The model did not answer within the gateway's timeout; retry with fewer texts",
                            kind="timeout", code="timeout")
    if isinstance(err, ServerUnavailable):
        return GatewayError("The model server is unreachable; retry after the Retry-After seconds",
                            kind="unavailable", code="triton_unavailable", retry_after_s=retry_after_s)
    if isinstance(err, ModelConfigError):
        return GatewayError("The model is not available (its server does not serve it as this gateway expects); "
                            "retry after the Retry-After seconds", kind="unavailable", code="model_unavailable",
                            retry_after_s=retry_after_s)
    return GatewayError("The model server failed the request", kind="backend", code="backend_error")


def openai_body(err: GatewayError) -> dict[str, Any]:
    """OpenAI's JSON error shape."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def tei_body(err: GatewayError) -> dict[str, Any]:
    """TEI's JSON error shape for /embed: {"error", "error_type"}."""
    return {"error": err.message, "error_type": KINDS[err.kind][3]}

"""The gateway's errors and the ONE place that maps them (and the SDK's KitErrors) to HTTP answers.

OpenAI's error body: {"error": {"message", "type", "param", "code"}}; overload and unreachable
answers carry Retry-After so the `openai` client (which retries 429 and 5xx) backs off.
"""
from __future__ import annotations

from typing import Any

from bge_triton.errors import InputError, KitError, ModelConfigError, Overloaded, ServerUnavailable

__all__ = ["GatewayError", "BadRequest", "from_kit_error", "openai_body", "tei_body"]


class GatewayError(KitError):
    """One failed request: HTTP status, OpenAI error type and code, the offending parameter."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None,
                 code: str | None = None, type_: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status or self.status
        self.code = code or self.code
        self.type = type_ or self.type
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        """Retry-After for overload / unreachable answers; WWW-Authenticate for 401."""
        out = {}
        if self.retry_after_s is not None:
            out["retry-after"] = str(self.retry_after_s)
        if self.status == 401:
            out["www-authenticate"] = 'Bearer realm="bge-triton gateway"'
        return out


class BadRequest(GatewayError):
    """400: the request is malformed or asks for something this model cannot give."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


def too_large(message: str, param: str | None = None) -> GatewayError:
    """413: body bytes or inputs per request above the configured limit."""
    return GatewayError(message, param=param, status=413, type_="invalid_request_error", code="request_too_large")


def unknown_model(name: Any, served: tuple[str, ...]) -> GatewayError:
    """404: `model` names nothing this gateway serves."""
    return GatewayError(f"The model {name!r} does not exist here; this gateway serves {', '.join(served)}. "
                        "Send one of those as `model` (GET /v1/models lists them).",
                        param="model", status=404, type_="invalid_request_error", code="model_not_found")


def unauthorized(message: str) -> GatewayError:
    """401: missing or unknown bearer key."""
    return GatewayError(message, status=401, type_="invalid_request_error", code="invalid_api_key")


def rate_limited(retry_after_s: int, rate: float) -> GatewayError:
    """429: this key sent more than its request-rate limit."""
    return GatewayError(f"Rate limit reached for this API key ({rate:g} requests/s); retry after "
                        f"{retry_after_s} s or ask for a higher --rate-limit.", status=429,
                        type_="rate_limit_error", code="rate_limit_exceeded", retry_after_s=retry_after_s)


def overloaded(message: str, retry_after_s: int) -> GatewayError:
    """503: the gateway's in-flight limit or Triton's queue is full."""
    return GatewayError(message, status=503, type_="server_error", code="server_overloaded",
                        retry_after_s=retry_after_s)


def from_kit_error(err: KitError, retry_after_s: int) -> GatewayError:
    """Map an SDK error to the gateway's answer: input 400, overload 503, unreachable 503, else 500."""
    if isinstance(err, GatewayError):
        return err
    text = str(err)
    if isinstance(err, InputError):
        return BadRequest(text, param="input")
    if isinstance(err, Overloaded):
        return overloaded(f"Triton is overloaded: {text}", retry_after_s)
    if isinstance(err, ServerUnavailable):
        timed_out = "no answer within timeout_s" in text
        return GatewayError(text, status=504 if timed_out else 503, type_="server_error",
                            code="timeout" if timed_out else "triton_unavailable",
                            retry_after_s=None if timed_out else retry_after_s)
    if isinstance(err, ModelConfigError):
        return GatewayError(f"the Triton model is not available: {text}", status=503, type_="server_error",
                            code="model_unavailable", retry_after_s=retry_after_s)
    return GatewayError(f"Triton failed the request: {text}")


def openai_body(err: GatewayError) -> dict[str, Any]:
    """OpenAI's JSON error shape."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


_TEI_TYPES = {400: "Validation", 401: "Unauthorized", 404: "Validation", 413: "Validation",
              429: "Overloaded", 503: "Overloaded", 504: "Backend"}


def tei_body(err: GatewayError) -> dict[str, Any]:
    """TEI's JSON error shape for /embed: {"error", "error_type"}."""
    return {"error": err.message, "error_type": _TEI_TYPES.get(err.status, "Backend")}

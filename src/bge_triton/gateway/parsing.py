"""Body -> one checked request, in the words of the API it came through; large bodies in a worker process.

JSON parsing and validation hold the GIL (orjson and pydantic-core alike): in a worker *thread* a 5 MB body
still froze the event loop for 40-120 ms (measured, docs/gateway.md). So a body above PROCESS_ABOVE bytes is
parsed in a worker process (anyio.to_process, a bounded limiter), which hands back each text already encoded
as UTF-8 (client.core.Utf8): unpickling bytes is a copy, decoding them again would be the same stall.
A text over the character limit is cut (truncate START / END: TEI's rule, ahead of its tokenizer) or refused
with 413 (NONE) before anyone tokenizes it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ValidationError

from bge_triton.client.core import Utf8
from bge_triton.gateway.errors import GatewayError, bad_request, too_large
from bge_triton.gateway.models import EmbeddingsRequest, TeiEmbedRequest

__all__ = ["Parsed", "ParseLimits", "parse", "parse_in_worker", "PROCESS_ABOVE", "CHARS_PER_TOKEN"]

PROCESS_ABOVE = 64 * 1024  # bytes: parsing more than this on the loop costs over ~1 ms here
CHARS_PER_TOKEN = 250  # TEI's MAX_CHAR_MULTIPLIER: no token spans more characters; longer texts are cut first
_OPENAI_FIELDS = ", ".join(EmbeddingsRequest.model_fields)
_TEI_FIELDS = ", ".join(TeiEmbedRequest.model_fields)


@dataclasses.dataclass(frozen=True)
class ParseLimits:
    """What parsing needs to know: items per request, characters per text (0: no limit)."""

    max_inputs: int
    max_chars: int


@dataclasses.dataclass
class Parsed:
    """One checked request: the texts (str, or Utf8 from a worker) and what to do with them."""

    texts: list[str | Utf8]
    model: str | None  # OpenAI's `model`; None on TEI routes
    base64: bool
    query: bool
    truncate: str  # NONE | START | END
    dimensions: int | None


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not isinstance(p, str) or not p.startswith(("function-", "list[")))


def _from_validation(exc: ValidationError, tei: bool) -> GatewayError:
    """The first problem, named by its field; never pydantic's own wording of internals."""
    err = exc.errors(include_url=False)[0]
    kind, field = err["type"], _field(err["loc"])
    if kind == "json_invalid":
        return bad_request(f"the body is not valid JSON ({err['ctx']['error']}); send application/json",
                           code="invalid_json", tei=tei, status=400)
    if kind == "model_type" or not field:
        return bad_request("the body must be a JSON object like "
                           + ('{"inputs": ["..."]}' if tei else '{"model": ..., "input": ["..."]}'),
                           code="invalid_json", tei=tei)
    if kind == "missing":
        return bad_request(f"`{field}` is required", param=field, tei=tei)
    if kind == "extra_forbidden":
        return bad_request(f"`{field}` is not a field of this request; the fields are "
                           f"{_TEI_FIELDS if tei else _OPENAI_FIELDS}", param=field, code="unknown_parameter", tei=tei)
    if kind in ("invalid_text", "token_ids"):
        return bad_request(err["msg"], param=field.split("[")[0], tei=tei,
                           code="unsupported_input" if kind == "token_ids" else "invalid_value")
    if kind == "literal_error" and field == "normalize":
        return bad_request(f"`normalize` is {err['input']!r}: the model L2-normalises inside its graph, so only "
                           "normalize=true is served; drop the field", param="normalize", tei=tei)
    if kind == "literal_error":
        return bad_request(f"`{field}` is {err['input']!r}; use one of {err['ctx']['expected']}", param=field, tei=tei)
    return bad_request(f"`{field}`: {err['msg'].lower()}, got {err['input']!r}"[:500], param=field, tei=tei)


def _cut(texts: list[str], truncate: str, field: str, limits: ParseLimits, tei: bool) -> list[str]:
    """Texts over the character limit: cut to it from the side truncation drops, or refused (NONE) with 413."""
    limit = limits.max_chars
    if not limit or all(len(t) <= limit for t in texts):
        return texts
    out = []
    for i, text in enumerate(texts):
        if len(text) > limit:
            if truncate == "NONE":
                where = field if len(texts) == 1 else f"{field}[{i}]"
                raise too_large(f"`{where}` has {len(text)} characters, over the limit of {limit} "
                                f"({CHARS_PER_TOKEN} per token of the model's limit, --max-input-chars) for a text "
                                "that may not be truncated: shorten it, or send "
                                + ("truncate=true" if tei else "truncate END or START"), param=field,
                                code="context_length_exceeded", tei=tei)
            text = text[-limit:] if truncate == "START" else text[:limit]
        out.append(text)
    return out


def parse(body: bytes, tei: bool, limits: ParseLimits, encode: bool = False) -> Parsed:
    """The body as one checked request (GatewayError naming the field otherwise); encode: texts as Utf8."""
    try:
        if tei:
            t = TeiEmbedRequest.model_validate_json(body)
            texts, truncate = t.inputs, ("NONE" if not t.truncate else
                                         "START" if t.truncation_direction.lower() == "left" else "END")
            out = Parsed(texts, None, False, t.prompt_name == "query", truncate, t.dimensions)
        else:
            r = EmbeddingsRequest.model_validate_json(body)
            out = Parsed(r.input, r.model, r.encoding_format == "base64", r.input_type == "query",
                         r.truncate.upper(), r.dimensions)
    except ValidationError as exc:
        raise _from_validation(exc, tei) from None
    field = "inputs" if tei else "input"
    if len(out.texts) > limits.max_inputs:
        raise too_large(f"`{field}` has {len(out.texts)} items, the limit is {limits.max_inputs} per request "
                        "(--max-inputs): split it into several requests", param=field, tei=tei)
    texts = _cut([t for t in out.texts if isinstance(t, str)], out.truncate, field, limits, tei)
    out.texts = [Utf8(t.encode("utf-8")) for t in texts] if encode else list(texts)
    return out


def parse_in_worker(body: bytes, tei: bool, limits: ParseLimits) -> Parsed | tuple[str, dict[str, Any]]:
    """parse() for a worker process: a GatewayError comes back as ("error", its fields) (exceptions with
    keyword state do not survive pickling)."""
    try:
        return parse(body, tei, limits, encode=True)
    except GatewayError as exc:
        return "error", exc.fields()

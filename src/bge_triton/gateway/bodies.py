"""Request bodies, checked field by field: OpenAI's /v1/embeddings (with NIM's input_type and
truncate) and TEI's /embed. Each problem is a BadRequest naming the field and the fix."""
from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from bge_triton.gateway.errors import BadRequest, too_large, unknown_model
from bge_triton.gateway.texts import TRUNCATE_MODES

__all__ = ["EmbeddingsRequest", "parse_json", "parse_embeddings", "parse_tei"]

INPUT_TYPES = {"query": True, "passage": False}


@dataclasses.dataclass(frozen=True)
class EmbeddingsRequest:
    """One checked embeddings request."""

    texts: list[str]
    model: str
    base64: bool
    query: bool
    truncate: str
    user: str | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what it is instead."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON ({exc}); send application/json", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body is a JSON {type(data).__name__}, not an object like "
                         '{"model": ..., "input": [...]}', code="invalid_json")
    return data


def _texts(value: Any, param: str, max_inputs: int) -> list[str]:
    """A string or a list of non-empty strings; token-id arrays are named as unsupported."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest(f"`{param}` must be a string or a non-empty list of strings, got "
                         f"{'an empty list' if value == [] else type(value).__name__}", param=param)
    if len(value) > max_inputs:
        raise too_large(f"`{param}` has {len(value)} items, the limit is {max_inputs} per request "
                        "(--max-inputs): split it into several requests", param=param)
    for i, item in enumerate(value):
        if isinstance(item, (int, list)) and not isinstance(item, bool):
            raise BadRequest(f"`{param}[{i}]` is a token id {'array' if isinstance(item, list) else ''}: this "
                             "gateway embeds text only (its tokenizer is the server's, not tiktoken); send "
                             "strings", param=param, code="unsupported_input")
        if not isinstance(item, str):
            raise BadRequest(f"`{param}[{i}]` is {type(item).__name__}, not a string", param=param)
        if not item.strip():
            raise BadRequest(f"`{param}[{i}]` is empty or whitespace; drop empty texts before embedding",
                             param=param)
    return value


def _choice(data: dict[str, Any], key: str, allowed: tuple[str, ...], default: str, upper: bool = False) -> str:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, str) and (value.upper() if upper else value) in allowed:
        return value.upper() if upper else value
    raise BadRequest(f"`{key}` is {value!r}; use one of {', '.join(allowed)}", param=key)


def parse_embeddings(data: dict[str, Any], names: tuple[str, ...], dim: int, max_inputs: int) -> EmbeddingsRequest:
    """OpenAI's request: input, model, encoding_format, dimensions, user; NIM's input_type, truncate."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(f"`model` is required (a string); this gateway serves {', '.join(names)}", param="model")
    if model not in names:
        raise unknown_model(model, names)
    if "input" not in data:
        raise BadRequest("`input` is required: a string or a list of strings", param="input")
    texts = _texts(data["input"], "input", max_inputs)
    encoding = _choice(data, "encoding_format", ("float", "base64"), "float")
    dimensions = data.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or dimensions != dim):
        raise BadRequest(f"`dimensions` is {dimensions!r}, but {model} returns {dim}-dimensional embeddings "
                         f"and cannot shorten them: omit `dimensions` or send {dim}", param="dimensions")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"`user` must be a string, got {type(user).__name__}", param="user")
    input_type = _choice(data, "input_type", tuple(INPUT_TYPES), "passage")
    truncate = _choice(data, "truncate", TRUNCATE_MODES, "END", upper=True)
    return EmbeddingsRequest(texts, model, encoding == "base64", INPUT_TYPES[input_type], truncate, user)


def parse_tei(data: dict[str, Any], name: str, max_inputs: int) -> EmbeddingsRequest:
    """TEI's /embed: inputs, truncate (bool, default false), truncation_direction, normalize (must be true)."""
    if "inputs" not in data:
        raise BadRequest("`inputs` is required: a string or a list of strings", param="inputs")
    texts = _texts(data["inputs"], "inputs", max_inputs)
    normalize = data.get("normalize", True)
    if normalize is not True:
        raise BadRequest(f"`normalize` is {normalize!r}: the model L2-normalises inside its graph, so only "
                         "normalize=true is served; drop the field", param="normalize")
    truncate = data.get("truncate", False)
    if not isinstance(truncate, bool):
        raise BadRequest(f"`truncate` must be true or false, got {truncate!r}", param="truncate")
    direction = _choice(data, "truncation_direction", ("Right", "Left"), "Right")
    mode = "NONE" if not truncate else ("END" if direction == "Right" else "START")
    return EmbeddingsRequest(texts, name, False, False, mode)

"""The gateway's request and response bodies as pydantic models: the handlers validate with them and
/openapi.json is generated from them (gateway/openapi.py), so the document cannot drift from the code.

Texts are checked by one validator (`_texts`) with the messages of the API they came through; its JSON
schema says the same thing (a string with a visible character and no NUL, or a non-empty list of them).
"""
from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, RootModel, WithJsonSchema
from pydantic_core import PydanticCustomError

__all__ = ["EmbeddingsRequest", "TeiEmbedRequest", "EmbeddingsResponse", "TeiEmbedResponse", "OpenAIErrorBody",
           "TeiErrorBody", "ModelCard", "ModelList", "Health", "Ready", "VISIBLE_PATTERN", "TRUNCATE_MODES",
           "TEI_DIRECTIONS", "PROMPT_NAMES"]

TRUNCATE_MODES = ("NONE", "START", "END")
TEI_DIRECTIONS = ("Right", "Left", "right", "left")  # TEI accepts both spellings; its Python client sends lower case
PROMPT_NAMES = ("query", "passage")  # TEI prompt_name -> the gateway's input_type (the query instruction)
# The characters Python's str.isspace() calls whitespace: a text must have one character outside them (the text
# endpoint refuses whitespace-only texts with str.strip()) and no NUL. Spelled out, not \s: ECMA, Rust and
# Python disagree on \s (U+FEFF, U+0085, U+001C..U+001F), and the schema must say exactly what is accepted.
_SPACE = "".join(f"\\u{c:04x}" for c in range(sys.maxunicode + 1) if chr(c).isspace())
VISIBLE_PATTERN = f"^[^\\u0000]*[^\\u0000{_SPACE}][^\\u0000]*$"


def _text_error(where: str, problem: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_text", "`{where}` {problem}", {"where": where, "problem": problem})


def _check_text(item: Any, where: str) -> str:
    if isinstance(item, bool) or not isinstance(item, (str, int, list)):
        raise _text_error(where, f"is {type(item).__name__}, not a string")
    if isinstance(item, (int, list)):
        raise PydanticCustomError("token_ids", "`{where}` is a token id {kind}: this gateway embeds text only (its "
                                  "tokenizer is the model's, not tiktoken); send strings",
                                  {"where": where, "kind": "array" if isinstance(item, list) else "(a number)"})
    if not item.strip():
        raise _text_error(where, "is empty or whitespace only: send at least one visible character")
    if "\x00" in item:
        raise _text_error(where, "contains a NUL character (\\u0000): remove control characters")
    return item


def _texts(field: str) -> Any:
    """A string or a non-empty list of strings, each with a visible character and no NUL; always a list."""

    def check(value: Any) -> list[str]:
        if isinstance(value, str):
            return [_check_text(value, field)]
        if not isinstance(value, list) or not value:
            got = "an empty list" if value == [] else type(value).__name__
            raise _text_error(field, f"must be a string or a non-empty list of strings, got {got}")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise PydanticCustomError("token_ids", "`{where}` is a token id array: this gateway embeds text only "
                                      "(its tokenizer is the model's, not tiktoken); send strings", {"where": field})
        return [_check_text(v, f"{field}[{i}]") for i, v in enumerate(value)]

    text = {"type": "string", "pattern": VISIBLE_PATTERN, "minLength": 1}
    schema = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1}],
              "description": "one text, or a list of texts; each needs a visible character and no NUL"}
    return Annotated[list[str], PlainValidator(check, json_schema_input_type=str | list[str]),
                     WithJsonSchema(schema)]


class EmbeddingsRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's request, with NVIDIA NIM's input_type and truncate."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: 0 is not false, "5" is not 5

    input: _texts("input")  # type: ignore[valid-type]
    model: str = Field(description="a served model name (GET /v1/models)")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="only the model's own width is served")
    user: str | None = None
    input_type: Literal["query", "passage"] = Field("passage", description="query: the query instruction is "
                                                    "prepended and the request goes at the queries' priority")
    truncate: Literal["NONE", "START", "END", "none", "start", "end"] = Field(
        "END", description="a text over the model's token limit: NONE refuses it, START cuts its start, END its end")


class TeiEmbedRequest(BaseModel):
    """POST /embed (and POST /): text-embeddings-inference's request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: _texts("inputs")  # type: ignore[valid-type]
    truncate: bool | None = Field(None, description="cut a text over the token limit (default false: refuse it)")
    truncation_direction: Literal["Right", "Left", "right", "left"] = Field(
        "Right", description="Right cuts the end, Left the start (either spelling)")
    normalize: Literal[True] = Field(True, description="the model L2-normalises in its graph: only true is served")
    prompt_name: Literal["query", "passage"] | None = Field(
        None, description="query prepends the query instruction (and goes at the queries' priority)")
    dimensions: int | None = Field(None, description="only the model's own width is served")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[Embedding]
    usage: Usage


class TeiEmbedResponse(RootModel[list[list[float]]]):
    """One vector per input."""


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: OpenAIError


class TeiErrorBody(BaseModel):
    error: str
    error_type: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready", "not ready"]
    model: str
    error: str | None = None

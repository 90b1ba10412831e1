"""/openapi.json (OpenAPI 3.1) generated from the route table and the pydantic models the handlers validate
with (gateway/models.py), plus what this deployment decides (served names, the model's width, --max-inputs,
whether a key is needed); /docs is Swagger UI over it. Nothing here is a hand-kept copy of a schema."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from bge_triton.gateway.errors import KINDS
from bge_triton.gateway.models import OpenAIErrorBody, TeiErrorBody

__all__ = ["Operation", "build_openapi", "docs_html", "TIMING_HEADERS"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bge-triton-kit")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "0+unknown"


TIMING_HEADERS = ("x-tokenization-time", "x-queue-time", "x-inference-time", "x-total-time")
_TIMING_DOC = {"x-tokenization-time": "ms the text endpoint spent tokenizing this request",
               "x-queue-time": "ms its texts waited in the text endpoint's queue",
               "x-inference-time": "ms from its first encoder batch starting to its last returning",
               "x-total-time": "ms the gateway spent on the request, end to end"}
_ERROR_TEXT = {400: "malformed request (the message names the field)", 401: "missing or unknown API key",
               404: "unknown model", 413: "body, inputs or a text over the limit", 422: "a field TEI cannot serve",
               429: "rate limit / overloaded", 503: "overloaded or the model server is unreachable",
               504: "the model did not answer in time", 500: "the gateway or the model server failed the request",
               424: "the model server failed the request"}


@dataclasses.dataclass(frozen=True)
class Operation:
    """One route as the document describes it."""

    path: str
    method: str
    summary: str
    response: type[BaseModel] | None  # None: text/plain (metrics)
    request: type[BaseModel] | None = None
    tei: bool = False
    auth: bool = True
    timing: bool = False  # the x-*-time headers on 200
    errors: tuple[str, ...] = ()  # error kinds it can answer (KINDS)
    extra: tuple[int, ...] = ()  # other statuses with the response model (e.g. /ready's 503)


def _schemas(ops: list[Operation]) -> tuple[dict[Any, Any], dict[str, Any]]:
    models = {(op.request, "validation") for op in ops if op.request}
    models |= {(op.response, "serialization") for op in ops if op.response}
    models |= {(OpenAIErrorBody, "serialization"), (TeiErrorBody, "serialization")}
    ordered: list[Any] = sorted(models, key=lambda m: (m[0].__name__, m[1]))
    refs, top = models_json_schema(ordered,
                                   ref_template="#/components/schemas/{model}")
    return refs, top.get("$defs", {})


def _content(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def _deployment(schemas: dict[str, Any], names: tuple[str, ...], dim: int | None, max_inputs: int) -> None:
    """What this gateway decides, written into the generated schemas."""
    req = schemas["EmbeddingsRequest"]["properties"]
    req["model"]["enum"] = list(names)
    for name in ("EmbeddingsRequest", "TeiEmbedRequest"):
        props = schemas[name]["properties"]
        field = props["input" if name == "EmbeddingsRequest" else "inputs"]
        field["anyOf"][1]["maxItems"] = max_inputs
        if dim is not None:
            props["dimensions"] = {"anyOf": [{"const": dim, "type": "integer"}, {"type": "null"}], "default": None,
                                   "description": f"the model's width, {dim}, or null (nothing else is served)"}


def build_openapi(ops: list[Operation], *, names: tuple[str, ...], dim: int | None, max_inputs: int,
                  keyed: bool, retry_after: bool = True) -> dict[str, Any]:
    """The OpenAPI 3.1 document of these operations."""
    names_served = names
    refs, schemas = _schemas(ops)
    schemas = copy.deepcopy(schemas)
    _deployment(schemas, names, dim, max_inputs)
    paths: dict[str, Any] = {}
    for op in ops:
        ok: dict[str, Any] = {"description": "OK"}
        if op.response is not None:
            ok["content"] = _content(refs[(op.response, "serialization")])
        else:
            ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        if op.timing:
            ok["headers"] = {h: {"description": _TIMING_DOC[h], "schema": {"type": "string"}} for h in TIMING_HEADERS}
        responses: dict[str, Any] = {"200": ok}
        for status in op.extra:
            responses[str(status)] = {"description": "not ready", "content": ok["content"]}
        error_ref = refs[(TeiErrorBody if op.tei else OpenAIErrorBody, "serialization")]
        kinds = list(op.errors) + (["unauthorized", "rate_limited"] if op.auth and keyed else [])
        for status in sorted({KINDS[k][1] if op.tei else KINDS[k][0] for k in kinds}):
            entry: dict[str, Any] = {"description": _ERROR_TEXT.get(status, "error"), "content": _content(error_ref)}
            if status in (429, 503):
                entry["headers"] = {"retry-after": {"description": "seconds to wait", "schema": {"type": "string"}}}
            responses[str(status)] = entry
        operation: dict[str, Any] = {"summary": op.summary, "operationId": f"{op.method}{op.path}".replace("/", "_"),
                                     "responses": responses}
        params = [part[1:-1] for part in op.path.split("/") if part.startswith("{")]
        if params:
            operation["parameters"] = [{"name": n, "in": "path", "required": True,  # only {name}: a model name
                                        "schema": {"type": "string", "enum": list(names_served)}} for n in params]
        if op.request is not None:
            operation["requestBody"] = {"required": True, "content": _content(refs[(op.request, "validation")])}
        if op.auth and keyed:
            operation["security"] = [{"bearer": []}]
        paths.setdefault(op.path, {})[op.method.lower()] = operation
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "bge-triton-kit embeddings gateway", "version": _version(),
                 "description": "OpenAI-compatible /v1/embeddings and text-embeddings-inference's /embed in front of "
                                "a Triton text endpoint. Generated from the handlers' pydantic models."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def docs_html(openapi_url: str = "/openapi.json") -> str:
    """Swagger UI over the document (its script and style from the jsDelivr CDN, as FastAPI's /docs)."""
    base = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>bge-triton gateway - API</title>
<link rel="stylesheet" href="{base}/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="{base}/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{url: "{openapi_url}", dom_id: "#swagger-ui"}});</script>
<noscript>The API document is at <a href="{openapi_url}">{openapi_url}</a>.</noscript>
</body></html>
"""

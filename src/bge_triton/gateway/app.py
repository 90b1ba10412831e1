"""The ASGI app (plain Starlette routes): /v1/embeddings, /v1/models, /embed (TEI), /health, /ready, /metrics.

Each route is one async function wrapped by `_answer`, which owns auth, the in-flight gauge,
metrics, timing headers and the mapping of every error to its status and JSON shape.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bge_triton.errors import InputError, KitError
from bge_triton.gateway.auth import KeyGuard
from bge_triton.gateway.backend import Backend, TritonBackend
from bge_triton.gateway.bodies import EmbeddingsRequest, parse_embeddings, parse_json, parse_tei
from bge_triton.gateway.errors import GatewayError, from_kit_error, openai_body, tei_body, too_large, unknown_model
from bge_triton.gateway.metrics import GatewayMetrics
from bge_triton.gateway.settings import GatewaySettings
from bge_triton.gateway.texts import TextPreparer

__all__ = ["create_app"]

log = logging.getLogger("bge_triton.gateway")
THREAD_ABOVE = 16  # texts: tokenize larger requests (START, NONE's error path) in a worker thread
PRIORITY_HEADER = "x-priority"
PRIORITY_HEADER_RAW = PRIORITY_HEADER.encode()
ROUTES = "POST /v1/embeddings, GET /v1/models, POST /embed, GET /health, /ready, /metrics"
_JSON = "application/json"


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), status, headers, media_type=_JSON)


def _ms(seconds: float) -> bytes:
    return b"%.3f" % (seconds * 1000)


def _header(request: Request, name: bytes) -> str:
    """One request header ('' if absent) read from the raw ASGI list (header names arrive lower-cased)."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


class Gateway:
    """State of one app: settings, backend, text preparation, key guard, metrics."""

    def __init__(self, settings: GatewaySettings, backend: Backend, preparer: TextPreparer) -> None:
        self.s, self.backend, self.preparer = settings, backend, preparer
        self.guard = KeyGuard(settings.api_keys, settings.rate_limit, settings.rate_burst)
        self.metrics = GatewayMetrics()
        self._limited = False

    async def connected(self) -> None:
        """Make sure the model's config was read (dim, max_length); KitError -> 503 when Triton is down."""
        if self._limited:
            return
        await self.backend.connect()
        self.preparer.limit(self.backend.max_length)
        self._limited = True

    async def body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it passes --max-body-bytes."""
        limit = self.s.max_body_bytes
        declared = _header(request, b"content-length")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(f"the body has {declared} bytes, the limit is {limit} (--max-body-bytes): "
                            "send fewer or shorter inputs per request")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"the body passes {limit} bytes (--max-body-bytes): send fewer or shorter "
                                "inputs per request")
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def priority(self, req: EmbeddingsRequest, request: Request) -> int:
        """x-priority: high | low overrides input_type (query -> high, passage -> low)."""
        header = _header(request, PRIORITY_HEADER_RAW).lower()
        if header not in ("", "high", "low"):
            raise GatewayError(f"header {PRIORITY_HEADER}: {header!r}; use high or low", status=400,
                               type_="invalid_request_error", code="invalid_value", param=PRIORITY_HEADER)
        high = header == "high" if header else req.query
        return self.s.query_priority if high else self.s.passage_priority

    async def embed(self, req: EmbeddingsRequest, request: Request,
                    timing: dict[str, float]) -> tuple[np.ndarray, int]:
        """Prepare (instruction, truncate), embed (Triton, which counts the tokens), record the timings:
        the vectors and the request's total tokens."""
        priority = self.priority(req, request)
        t0 = time.perf_counter()
        big = len(req.texts) > THREAD_ABOVE
        texts, server_truncate = await _maybe_in_thread(big and req.truncate == "START", self.preparer.prepare,
                                                        req.texts, req.query, req.truncate)
        t1 = time.perf_counter()
        try:
            vectors, counts = await self.backend.embed(texts, priority=priority, truncate=server_truncate)
        except InputError:
            if req.truncate == "NONE":  # the text endpoint refused an over-long text: name it as OpenAI does
                await _maybe_in_thread(big, self.preparer.check_lengths, req.texts, req.query)
            raise
        t2 = time.perf_counter()
        total = int(counts.sum())
        self.metrics.embedded(priority, t2 - t1, len(texts), total)
        timing.update(tokenization=t1 - t0, inference=t2 - t1)
        return vectors, total


async def _maybe_in_thread(thread: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), in a worker thread when it tokenizes many texts, so the event loop keeps serving meanwhile."""
    return await asyncio.to_thread(fn, *args) if thread else fn(*args)


def _answer(gw: Gateway, route: str, fn: Callable[[Request, dict[str, float]], Awaitable[Response]],
            *, auth: bool = True, tei: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a route: key check, in-flight gauge, metrics, timing headers, errors in the route's shape."""
    metrics = gw.metrics

    async def handler(request: Request) -> Response:
        start = time.perf_counter()
        metrics.answering += 1
        timing: dict[str, float] = {}
        try:
            if auth:
                gw.guard.check(_header(request, b"authorization") or None)
            response = await fn(request, timing)
        except (GatewayError, KitError) as exc:
            err = from_kit_error(exc, gw.s.retry_after_s)
            if err.status >= 500:
                log.warning("%s %s -> %d: %s", request.method, route, err.status, err.message)
            response = _json(tei_body(err) if tei else openai_body(err), err.status, err.headers)
        finally:
            metrics.answering -= 1
        elapsed = time.perf_counter() - start
        raw = response.raw_headers  # appended, not set: nothing here is there already
        raw.append((b"x-total-time", _ms(elapsed)))
        for name, seconds in timing.items():
            raw.append((b"x-%s-time" % name.encode(), _ms(seconds)))
        gw.metrics.observe(route, response.status_code, elapsed)
        return response

    return handler


def _routes(gw: Gateway) -> list[Route]:
    async def embeddings(request: Request, timing: dict[str, float]) -> Response:
        data = parse_json(await gw.body(request))
        await gw.connected()
        req = parse_embeddings(data, gw.s.names, gw.backend.dim, gw.s.max_inputs)
        vectors, total = await gw.embed(req, request, timing)
        if req.base64:
            items: list[Any] = [base64.b64encode(v.tobytes()).decode("ascii") for v in vectors.astype("<f4", copy=False)]
        else:
            items = list(vectors)
        return _json({"object": "list", "model": req.model,
                      "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(items)],
                      "usage": {"prompt_tokens": total, "total_tokens": total}})

    async def tei_embed(request: Request, timing: dict[str, float]) -> Response:
        data = parse_json(await gw.body(request))
        await gw.connected()
        vectors, _ = await gw.embed(parse_tei(data, gw.s.model, gw.s.max_inputs), request, timing)
        return _json(vectors)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "bge-triton-kit"}

    async def models(request: Request, timing: dict[str, float]) -> Response:
        return _json({"object": "list", "data": [model_card(n) for n in gw.s.names]})

    async def model(request: Request, timing: dict[str, float]) -> Response:
        name = request.path_params["name"]
        if name not in gw.s.names:
            raise unknown_model(name, gw.s.names)
        return _json(model_card(name))

    async def health(request: Request, timing: dict[str, float]) -> Response:
        return _json({"status": "ok"})

    async def ready(request: Request, timing: dict[str, float]) -> Response:
        if gw.backend.ready():
            return _json({"status": "ready", "model": gw.s.model})
        return _json({"status": "not ready", "model": gw.s.model, "error": gw.backend.last_error},
                     503, {"retry-after": str(gw.s.retry_after_s)})

    async def metrics(request: Request, timing: dict[str, float]) -> Response:
        gw.metrics.ready.set(1 if gw.backend.ready() else 0)
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/v1/embeddings", _answer(gw, "/v1/embeddings", embeddings), methods=["POST"]),
        Route("/embeddings", _answer(gw, "/v1/embeddings", embeddings), methods=["POST"]),
        Route("/embed", _answer(gw, "/embed", tei_embed, tei=True), methods=["POST"]),
        Route("/v1/models", _answer(gw, "/v1/models", models), methods=["GET"]),
        Route("/v1/models/{name:path}", _answer(gw, "/v1/models/{name}", model), methods=["GET"]),
        Route("/health", _answer(gw, "/health", health, auth=False), methods=["GET"]),
        Route("/ready", _answer(gw, "/ready", ready, auth=False), methods=["GET"]),
        Route("/metrics", _answer(gw, "/metrics", metrics, auth=False), methods=["GET"]),
    ]


def create_app(settings: GatewaySettings, backend: Backend | None = None,
               preparer: TextPreparer | None = None) -> "_Direct":
    """The gateway app; backend and preparer are built from settings unless given (tests pass fakes)."""
    backend = backend or TritonBackend(settings)
    preparer = preparer or TextPreparer(settings.tokenizer_dir, 512, settings.query_instruction)
    gw = Gateway(settings, backend, preparer)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err = GatewayError(f"{request.method} {request.url.path}: {exc.detail}; the routes are {ROUTES}",
                           status=exc.status_code, type_="invalid_request_error",
                           code="not_found" if exc.status_code == 404 else "method_not_allowed")
        return _json(openai_body(err), exc.status_code)

    routes = _routes(gw)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.gateway = gw
    return _Direct(app, routes)


class _Direct:
    """The Starlette app with a direct way in for the exact-path routes: a request whose method and path
    name one goes straight to its handler (which answers every error itself); everything else (lifespan,
    path parameters, 404 / 405) takes Starlette's router. Saves its middleware and routing layers."""

    def __init__(self, app: Starlette, routes: list[Route]) -> None:
        self.app, self.state = app, app.state
        self.exact = {(method, r.path): r.endpoint for r in routes if "{" not in r.path for method in r.methods or ()}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            endpoint = self.exact.get((scope["method"], scope["path"]))
            if endpoint is not None:
                scope["app"] = self.app
                response = await endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

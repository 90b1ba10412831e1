"""The ASGI app (plain Starlette routes): /v1/embeddings, /v1/models, /embed and / (TEI), /health, /ready,
/metrics, /openapi.json, /docs.

Each route is one async function wrapped by `_answer`, which owns auth, the in-flight gauge, metrics,
timing headers and the mapping of every error to its status and JSON shape (errors.KINDS). Nothing on
the event loop costs more than about a millisecond per request: bodies over 64 KiB are parsed in worker
processes (gateway/parsing.py), large answers are encoded in slices with the loop served in between, and
the text endpoint (not the gateway) tokenizes, counts and cuts.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.to_process
import orjson
from numpy.typing import NDArray
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from bge_triton.client import Utf8
from bge_triton.errors import KitError
from bge_triton.gateway import models as m
from bge_triton.gateway.auth import KeyGuard
from bge_triton.gateway.backend import Backend, TritonBackend
from bge_triton.gateway.errors import (
    GatewayError,
    bad_request,
    from_kit_error,
    openai_body,
    tei_body,
    too_large,
    unknown_model,
)
from bge_triton.gateway.metrics import GatewayMetrics, watch_loop
from bge_triton.gateway.openapi import Operation, build_openapi, docs_html
from bge_triton.gateway.parsing import CHARS_PER_TOKEN, PROCESS_ABOVE, Parsed, ParseLimits, parse, parse_in_worker
from bge_triton.gateway.rerank import Reranker, rerank_routes
from bge_triton.gateway.settings import GatewaySettings
from bge_triton.gateway.texts import TextPreparer
from bge_triton.gateway.verified import Check, ReferenceGate

__all__ = ["create_app"]

log = logging.getLogger("bge_triton.gateway")
PRIORITY_HEADER = "x-priority"
PRIORITY_HEADER_RAW = PRIORITY_HEADER.encode()
ROWS_PER_SLICE = 32  # answer encoding: rows per slice between two turns of the event loop
_JSON = "application/json"
_EMBED_ERRORS = ("invalid_json", "invalid", "too_long", "too_large", "not_found", "overloaded", "unavailable",
                 "timeout", "backend", "internal")


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), status, headers, media_type=_JSON)


def _ms(seconds: float) -> bytes:
    return b"%.3f" % (seconds * 1000)


def _header(request: Request, name: bytes) -> str:
    """One request header ('' if absent) read from the raw ASGI list (header names arrive lower-cased)."""
    for key, value in request.scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


async def _sliced(vectors: NDArray[Any], row: Callable[[int, NDArray[Any]], bytes]) -> bytes:
    """b','.join(row(i, v)): in slices of ROWS_PER_SLICE rows, the loop served between two slices."""
    parts = []
    for start in range(0, len(vectors), ROWS_PER_SLICE):
        parts.append(b",".join(row(start + i, v) for i, v in enumerate(vectors[start:start + ROWS_PER_SLICE])))
        if len(vectors) > ROWS_PER_SLICE:
            await asyncio.sleep(0)
    return b",".join(parts)


async def openai_payload(vectors: NDArray[Any], model: str, tokens: int, as_base64: bool) -> bytes:
    """OpenAI's embeddings list as JSON bytes (base64: little-endian float32)."""
    if as_base64:
        little = vectors.astype("<f4", copy=False)
        row = lambda i, v: b'{"object":"embedding","index":%d,"embedding":"%s"}' % (  # noqa: E731
            i, base64.b64encode(v.tobytes()))
        rows = await _sliced(little, row)
    else:
        rows = await _sliced(vectors, lambda i, v: b'{"object":"embedding","index":%d,"embedding":%s}' % (
            i, orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY)))
    return b'{"object":"list","model":%s,"data":[%s],"usage":{"prompt_tokens":%d,"total_tokens":%d}}' % (
        orjson.dumps(model), rows, tokens, tokens)


async def tei_payload(vectors: NDArray[Any]) -> bytes:
    """TEI's answer: one JSON array of floats per input."""
    return b"[%s]" % await _sliced(vectors, lambda i, v: orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY))


class Gateway:
    """State of one app: settings, backend, the optional local tokenizer, key guard, metrics."""

    def __init__(self, settings: GatewaySettings, backend: Backend, preparer: TextPreparer | None,
                 verify: Check | None = None) -> None:
        self.s, self.backend, self.preparer = settings, backend, preparer
        self.guard = KeyGuard(settings.api_keys, settings.rate_limit, settings.rate_burst)
        self.metrics = GatewayMetrics(verified=settings.reference is not None)
        gauge = self.metrics.verified
        self.gate = None if settings.reference is None else ReferenceGate(
            settings, backend, verify, on_verdict=None if gauge is None else lambda ok: gauge.set(int(ok)))
        self.parsers = anyio.CapacityLimiter(settings.parse_workers)
        self.limits = ParseLimits(settings.max_inputs, settings.max_input_chars)
        self._limited = False
        self._openapi: bytes | None = None
        self.reranker = Reranker(settings) if settings.rerank_model else None  # --rerank-model: /rerank, /v1/rerank

    def not_ready(self) -> str | None:
        """Why /ready is 503 (None: ready): no embedding went through lately, or --reference does not hold yet."""
        if not self.backend.ready():
            return self.backend.last_error
        if self.gate is not None and not self.gate.ok:
            return self.gate.message
        return self.reranker.not_ready() if self.reranker is not None else None

    async def connected(self) -> None:
        """Make sure the model's config was read (dim, max_length); KitError -> 503 when Triton is down."""
        if self._limited:
            return
        await self.backend.connect()
        if self.preparer is not None:
            self.preparer.limit(self.backend.max_length)
        chars = self.s.max_input_chars or CHARS_PER_TOKEN * self.backend.max_length
        self.limits = ParseLimits(self.s.max_inputs, chars)
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

    async def parse(self, body: bytes, tei: bool) -> Parsed:
        """The checked request: on the loop when small, in a worker process (bounded by --parse-workers) when not."""
        if len(body) <= PROCESS_ABOVE:
            return parse(body, tei, self.limits)
        out = await anyio.to_process.run_sync(parse_in_worker, body, tei, self.limits, limiter=self.parsers)
        if isinstance(out, tuple):
            raise GatewayError(**out[1])
        return out

    def priority(self, query: bool, request: Request) -> int:
        """x-priority: high | low overrides input_type (query -> high, passage -> low)."""
        header = _header(request, PRIORITY_HEADER_RAW).lower()
        if header not in ("", "high", "low"):
            raise bad_request(f"header {PRIORITY_HEADER}: {header!r}; use high or low", param=PRIORITY_HEADER)
        high = header == "high" if header else query
        return self.s.query_priority if high else self.s.passage_priority

    async def _texts(self, p: Parsed, tei: bool) -> tuple[list[Any], bool, str]:
        """The texts to send (query instruction added; START cut locally only for an old text endpoint),
        the endpoint's `truncate` and truncation_direction."""
        prefix = self.s.query_instruction if p.query else ""
        texts = p.texts
        if prefix:
            raw = prefix.encode("utf-8")
            texts = [Utf8(raw + t) if isinstance(t, Utf8) else prefix + t for t in texts]
        if p.truncate != "START":
            return texts, p.truncate == "END", "right"
        if self.backend.cuts_start:
            return texts, True, "left"
        if self.preparer is None:
            raise bad_request("`truncate` START: this deployment's text endpoint cannot cut the start of a text "
                              "(deploy the kit's current one, or start the gateway with --tokenizer); send END",
                              param="truncation_direction" if tei else "truncate")
        plain = [bytes(t).decode("utf-8") if isinstance(t, Utf8) else t for t in p.texts]
        cut = await anyio.to_thread.run_sync(self.preparer.keep_tails, plain, prefix)
        return [prefix + t for t in cut], True, "right"

    async def embed(self, p: Parsed, request: Request, timing: dict[str, float], tei: bool) -> tuple[NDArray[Any], int]:
        """Embed one checked request (Triton counts the tokens and cuts): the vectors and the total tokens."""
        dim = self.backend.dim
        if p.dimensions is not None and p.dimensions != dim:
            raise bad_request(f"`dimensions` is {p.dimensions}, but the model returns {dim}-dimensional embeddings "
                              f"and cannot shorten them: omit `dimensions` or send {dim}", param="dimensions")
        priority = self.priority(p.query, request)
        t0 = time.perf_counter()
        texts, truncate, direction = await self._texts(p, tei)
        t1 = time.perf_counter()
        try:
            vectors, counts, endpoint = await self.backend.embed(texts, priority=priority, truncate=truncate,
                                                                 direction=direction)
        except KitError as exc:
            raise from_kit_error(exc, self.s.retry_after_s, tei, len(texts), p.query, self.backend.max_batch) from None
        t2 = time.perf_counter()
        total = int(counts.sum())
        self.metrics.embedded(priority, t2 - t1, len(texts), total)
        if endpoint is not None:
            timing.update(tokenization=t1 - t0 + endpoint.tokenization_s, queue=endpoint.queue_s,
                          inference=endpoint.inference_s)
        else:  # an older text endpoint: the whole Triton call is the inference
            timing.update(tokenization=t1 - t0, queue=0.0, inference=t2 - t1)
        return vectors, total


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
        except Exception as exc:
            if isinstance(exc, KitError):
                err = from_kit_error(exc, gw.s.retry_after_s, tei)
            else:
                log.exception("%s %s failed", request.method, route)
                err = GatewayError("The gateway failed the request (logged); retry it")
            status = err.status_for(tei)
            if status >= 500:
                log.warning("%s %s -> %d: %s", request.method, route, status, err.message)
            response = _json(tei_body(err) if tei else openai_body(err), status, err.headers)
        finally:
            metrics.answering -= 1
        elapsed = time.perf_counter() - start
        raw = response.raw_headers  # appended, not set: nothing here is there already
        for name, seconds in timing.items():
            raw.append((b"x-%s-time" % name.encode(), _ms(seconds)))
        raw.append((b"x-total-time", _ms(elapsed)))
        gw.metrics.observe(route, response.status_code, elapsed)
        gw.metrics.stages(timing)
        return response

    return handler


def _routes(gw: Gateway) -> tuple[list[Route], list[Operation]]:
    async def embeddings(request: Request, timing: dict[str, float]) -> Response:
        body = await gw.body(request)
        await gw.connected()
        p = await gw.parse(body, tei=False)
        if p.model not in gw.s.names:
            raise unknown_model(p.model, gw.s.names)
        vectors, total = await gw.embed(p, request, timing, tei=False)
        return Response(await openai_payload(vectors, p.model, total, p.base64), media_type=_JSON)

    async def tei_embed(request: Request, timing: dict[str, float]) -> Response:
        body = await gw.body(request)
        await gw.connected()
        vectors, _ = await gw.embed(await gw.parse(body, tei=True), request, timing, tei=True)
        return Response(await tei_payload(vectors), media_type=_JSON)

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
        error = gw.not_ready()
        if error is None:
            return _json({"status": "ready", "model": gw.s.model})
        return _json({"status": "not ready", "model": gw.s.model, "error": error},
                     503, {"retry-after": str(gw.s.retry_after_s)})

    async def metrics(request: Request, timing: dict[str, float]) -> Response:
        gw.metrics.ready.set(1 if gw.not_ready() is None else 0)
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    E = _EMBED_ERRORS
    table: list[tuple[Operation, Callable[..., Awaitable[Response]], str]] = [
        (Operation("/v1/embeddings", "POST", "OpenAI: embed texts", m.EmbeddingsResponse, m.EmbeddingsRequest,
                   timing=True, errors=E), embeddings, "/v1/embeddings"),
        (Operation("/embeddings", "POST", "OpenAI: embed texts (without /v1)", m.EmbeddingsResponse,
                   m.EmbeddingsRequest, timing=True, errors=E), embeddings, "/v1/embeddings"),
        (Operation("/embed", "POST", "TEI: embed texts", m.TeiEmbedResponse, m.TeiEmbedRequest, tei=True,
                   timing=True, errors=E), tei_embed, "/embed"),
        (Operation("/", "POST", "TEI: embed texts (as /embed)", m.TeiEmbedResponse, m.TeiEmbedRequest, tei=True,
                   timing=True, errors=E), tei_embed, "/embed"),
        (Operation("/v1/models", "GET", "OpenAI: the served model names", m.ModelList), models, "/v1/models"),
        (Operation("/v1/models/{name}", "GET", "OpenAI: one served model", m.ModelCard, errors=("not_found",)),
         model, "/v1/models/{name}"),
        (Operation("/health", "GET", "liveness (no key needed)", m.Health, auth=False), health, "/health"),
        (Operation("/ready", "GET", "readiness: an embedding went through lately and, with --reference, the served "
                   "model reproduced its export's reference vectors (no key needed)", m.Ready,
                   auth=False, extra=(503,)), ready, "/ready"),
        (Operation("/metrics", "GET", "Prometheus metrics (no key needed)", None, auth=False), metrics, "/metrics"),
        *rerank_routes(gw),
    ]
    routes = [Route(op.path.replace("{name}", "{name:path}"),
                    _answer(gw, label, fn, auth=op.auth, tei=op.tei), methods=[op.method])
              for op, fn, label in table]
    return routes, [op for op, _, _ in table]


def create_app(settings: GatewaySettings, backend: Backend | None = None,
               preparer: TextPreparer | None = None, verify: Check | None = None) -> _Direct:
    """The gateway app; backend (and the optional local tokenizer) are built from settings unless given;
    verify replaces bge_triton.verify.check behind --reference (unit tests)."""
    real: Backend = backend if backend is not None else TritonBackend(settings)
    if preparer is None and settings.tokenizer_dir:
        preparer = TextPreparer(settings.tokenizer_dir, 512)
    gw = Gateway(settings, real, preparer, verify)
    routes, operations = _routes(gw)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await real.start()
        if gw.reranker is not None:
            await gw.reranker.start()
        if gw.gate is not None:
            await gw.gate.start()  # after the canary: it checks once an embedding went through
        warm = asyncio.create_task(_warm_parser(gw))  # the first big body should not wait for a worker to start
        watch = asyncio.create_task(watch_loop(gw.metrics))  # gateway_event_loop_lag_seconds
        try:
            yield
        finally:
            for task in (warm, watch):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if gw.gate is not None:
                await gw.gate.close()
            await real.close()
            if gw.reranker is not None:
                await gw.reranker.close()

    async def openapi(request: Request) -> Response:
        if gw._openapi is None:
            with contextlib.suppress(KitError):
                await gw.connected()  # the model's width goes into the document once Triton answered
            doc = build_openapi(operations, names=settings.names, dim=gw.backend.dim if gw._limited else None,
                                max_inputs=settings.max_inputs, keyed=gw.guard.enabled)
            body = orjson.dumps(doc)
            if not gw._limited:
                return Response(body, media_type=_JSON)
            gw._openapi = body
        return Response(gw._openapi, media_type=_JSON)

    async def docs(request: Request) -> Response:
        return HTMLResponse(docs_html())

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found" if exc.status_code == 404 else "method" if exc.status_code == 405 else "invalid"
        paths = ", ".join(f"{op.method} {op.path}" for op in operations)
        err = GatewayError(f"{request.method} {request.url.path}: {exc.detail}; the routes are {paths}",
                           kind=kind, code="not_found" if exc.status_code == 404 else "method_not_allowed",
                           status=exc.status_code)
        return _json(openai_body(err), exc.status_code, dict(exc.headers or {}))  # 405 keeps its Allow header

    routes += [Route("/openapi.json", openapi, methods=["GET"]), Route("/docs", docs, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.gateway = gw
    return _Direct(app, routes)


async def _warm_parser(gw: Gateway) -> None:
    """Start the parse workers once (each imports pydantic and the models: about a second)."""
    try:
        await anyio.to_process.run_sync(parse_in_worker, b'{"inputs": "warm"}', True, gw.limits, limiter=gw.parsers)
    except Exception as exc:
        log.warning("parse worker did not start: %s", exc)


class _Direct:
    """The Starlette app with a direct way in for the exact-path routes: a request whose method and path
    name one goes straight to its handler (which answers every error itself); everything else (lifespan,
    path parameters, 404 / 405) takes Starlette's router. Saves its middleware and routing layers."""

    def __init__(self, app: Starlette, routes: list[Route]) -> None:
        self.app, self.state = app, app.state
        self.exact = {(method, r.path): r.endpoint for r in routes if "{" not in r.path for method in r.methods or ()
                      if method != "HEAD"}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            endpoint = self.exact.get((scope["method"], scope["path"]))
            if endpoint is not None:
                scope["app"] = self.app
                response = await endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

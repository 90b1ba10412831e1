"""The reranker's routes: TEI's POST /rerank and the Cohere / Jina-shaped POST /v1/rerank, served when the gateway
runs with --rerank-model (the reranker's text-pair endpoint on the same Triton).

Both go through app._answer like the embeddings (auth, limits, metrics, x-*-time headers, errors in the route's
shape). The endpoint tokenizes, cuts and scores; the gateway checks the body (in a worker process above 64 KiB),
sends the pairs through the kit's async SDK and sorts. Scores: the sigmoid of the logit (TEI's default, Cohere's
relevance_score), or the logit with TEI's raw_scores. Priority: x-priority high | low; without it a request of up
to QUERY_DOCUMENTS documents (a RAG top-k) goes at the queries' level, a longer one at the bulk level, so a big
rerank never holds the small ones. /ready also needs a rerank through Triton within --ready-max-age.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from pydantic import ValidationError

from bge_triton.client import AsyncEmbeddingClient, Ranked, RetryPolicy
from bge_triton.errors import InputError, KitError
from bge_triton.gateway.backend import stop_task
from bge_triton.gateway.errors import GatewayError, bad_request, from_kit_error, overloaded, too_large, unknown_model
from bge_triton.gateway.parsing import CHARS_PER_TOKEN, PROCESS_ABOVE, _from_validation
from bge_triton.gateway.rerank_models import RerankRequest, RerankResponse, TeiRerankRequest, TeiRerankResponse
from bge_triton.gateway.settings import GatewaySettings

__all__ = ["TeiRerankRequest", "RerankRequest", "RerankResponse", "TeiRerankResponse", "RerankParsed",
           "parse_rerank", "Reranker", "QUERY_DOCUMENTS"]

log = logging.getLogger("bge_triton.gateway")
QUERY_DOCUMENTS = 100  # up to this many documents a rerank goes at the queries' priority (x-priority overrides)
MAX_LENGTH = 512  # characters per document are limited to CHARS_PER_TOKEN x this (or --max-input-chars)


@dataclasses.dataclass
class RerankParsed:
    """One checked rerank request."""

    query: str
    documents: list[str]
    model: str | None
    top_n: int | None
    return_documents: bool
    raw: bool
    truncate: bool
    direction: str


def parse_rerank(body: bytes, tei: bool, max_documents: int, max_chars: int) -> RerankParsed:
    """The body as one checked request; GatewayError names the field and the fix."""
    try:
        if tei:
            t = TeiRerankRequest.model_validate_json(body)
            out = RerankParsed(t.query, t.texts, None, None, t.return_text, t.raw_scores, bool(t.truncate),
                               t.truncation_direction.lower())
        else:
            r = RerankRequest.model_validate_json(body)
            docs = [d if isinstance(d, str) else d.text for d in r.documents]
            out = RerankParsed(r.query, docs, r.model, r.top_n, r.return_documents, False, True, "right")
    except ValidationError as exc:
        raise _from_validation(exc, tei) from None
    field = "texts" if tei else "documents"
    if not out.query.strip() or "\x00" in out.query:
        raise bad_request("`query` is empty or holds a NUL character: send a query with visible characters",
                          param="query", tei=tei)
    if not out.documents:
        raise bad_request(f"`{field}` is empty: send at least one document to rank", param=field, tei=tei)
    if len(out.documents) > max_documents:
        raise too_large(f"`{field}` has {len(out.documents)} documents, the limit is {max_documents} per request "
                        "(--max-inputs): split them into several requests", param=field, tei=tei)
    for i, doc in enumerate(out.documents):
        if not doc.strip() or "\x00" in doc:
            raise bad_request(f"`{field}[{i}]` is empty or holds a NUL character: send visible text",
                              param=field, tei=tei)
        if max_chars and len(doc) > max_chars:
            if not out.truncate:
                raise too_large(f"`{field}[{i}]` has {len(doc)} characters, over the limit of {max_chars}: "
                                "shorten it or send truncate=true", param=field, code="context_length_exceeded",
                                tei=tei)
            out.documents[i] = doc[-max_chars:] if out.direction == "left" else doc[:max_chars]
    if max_chars and len(out.query) > max_chars:
        raise too_large(f"`query` has {len(out.query)} characters, over the limit of {max_chars}: shorten it",
                        param="query", tei=tei)
    return out


def parse_rerank_in_worker(body: bytes, tei: bool, max_documents: int, max_chars: int
                           ) -> RerankParsed | tuple[str, dict[str, Any]]:
    """parse_rerank for a worker process: a GatewayError comes back as ("error", its fields)."""
    try:
        return parse_rerank(body, tei, max_documents, max_chars)
    except GatewayError as exc:
        return "error", exc.fields()


def _gateway_error(err: KitError, settings: GatewaySettings, tei: bool) -> GatewayError:
    """An SDK error in the rerank routes' words (the endpoint's own message names the document)."""
    if isinstance(err, InputError):
        text = str(err)
        reason = text.split("the server rejected the input: ", 1)[-1].split(". Fix the input", 1)[0]
        long = "over the limit" in reason or "the query has" in reason
        field = "texts" if tei else "documents"
        if long:
            return GatewayError(f"{reason}", kind="too_long", param=field, code="context_length_exceeded")
        return bad_request(reason, param=field, tei=tei)
    return from_kit_error(err, settings.retry_after_s, tei)


class Reranker:
    """The gateway's way to the reranker: the async SDK, an in-flight limit, and a canary for /ready."""

    def __init__(self, settings: GatewaySettings) -> None:
        assert settings.rerank_model is not None
        self.s, self.model = settings, settings.rerank_model
        retry = RetryPolicy(max_attempts=settings.triton_attempts, total_s=settings.timeout_s)
        self.client = AsyncEmbeddingClient(settings.triton, model=settings.model, timeout_s=settings.timeout_s,
                                           retry=retry, rerank_model=self.model)
        self.in_flight = 0
        self.last_ok = float("-inf")
        self.last_error = "no rerank canary has run yet"
        self._canary: asyncio.Task[None] | None = None
        self.max_chars = settings.max_input_chars or CHARS_PER_TOKEN * MAX_LENGTH

    def not_ready(self) -> str | None:
        """Why /ready is 503 for the reranker (None: a rerank went through within --ready-max-age)."""
        if time.monotonic() - self.last_ok <= self.s.ready_max_age_s:
            return None
        return f"reranker {self.model}: {self.last_error}"

    async def start(self) -> None:
        if self._canary is None:
            self._canary = asyncio.create_task(self._canary_loop())

    async def close(self) -> None:
        await stop_task(self._canary)
        await self.client.aclose()

    async def _canary_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:  # at the bulk level: a query would open the endpoint's query mode (app's canary says why)
                await self.client.rerank("ready", ["ready"], priority=self.s.passage_priority,
                                         timeout_s=min(self.s.ready_max_age_s, self.s.timeout_s))
                self.last_ok = time.monotonic()
            except KitError as exc:
                if self.last_error != str(exc):
                    log.warning("rerank canary failed: %s", exc)
                self.last_error = str(exc)
            await asyncio.sleep(max(0.0, self.s.canary_interval_s - (time.monotonic() - started)))

    async def parse(self, body: bytes, tei: bool, limiter: Any) -> RerankParsed:
        """parse_rerank on the loop when the body is small, in a worker process when not."""
        if len(body) <= PROCESS_ABOVE:
            return parse_rerank(body, tei, self.s.max_inputs, self.max_chars)
        import anyio.to_process

        out = await anyio.to_process.run_sync(parse_rerank_in_worker, body, tei, self.s.max_inputs, self.max_chars,
                                              limiter=limiter)
        if isinstance(out, tuple):
            raise GatewayError(**out[1])
        return out

    async def rank(self, p: RerankParsed, priority: int, timing: dict[str, float], tei: bool
                   ) -> tuple[list[Ranked], int]:
        """The ranked documents and the tokens of every pair; overloaded at once past --max-in-flight."""
        if self.in_flight >= self.s.max_in_flight:
            raise overloaded(f"The gateway has {self.in_flight} rerank requests at the model (--max-in-flight "
                             f"{self.s.max_in_flight}); retry after {self.s.retry_after_s} s", self.s.retry_after_s)
        self.in_flight += 1
        try:
            out = await self.client.rerank_with_timing(p.query, p.documents, p.top_n, truncate=p.truncate,
                                                       truncation_direction=p.direction, priority=priority)
        except KitError as exc:
            raise _gateway_error(exc, self.s, tei) from None
        finally:
            self.in_flight -= 1
        self.last_ok = time.monotonic()
        timing.update(tokenization=out.timing.tokenization_s, queue=out.timing.queue_s,
                      inference=out.timing.inference_s)
        return out.results, out.total_tokens


def priority_of(header: str, documents: int, settings: GatewaySettings, tei: bool) -> int:
    """x-priority high | low, else the queries' level up to QUERY_DOCUMENTS documents and the bulk level above."""
    header = header.lower()
    if header not in ("", "high", "low"):
        raise bad_request(f"header x-priority: {header!r}; use high or low", param="x-priority", tei=tei)
    high = header == "high" if header else documents <= QUERY_DOCUMENTS
    return settings.query_priority if high else settings.passage_priority


def tei_answer(p: RerankParsed, ranked: list[Ranked]) -> list[dict[str, Any]]:
    """TEI's [{index, score, text?}], highest score first."""
    return [{"index": r.index, "score": r.logit if p.raw else r.score,
             **({"text": p.documents[r.index]} if p.return_documents else {})} for r in ranked]


def cohere_answer(p: RerankParsed, ranked: list[Ranked], tokens: int, model: str) -> dict[str, Any]:
    """Cohere / Jina's {model, results: [{index, relevance_score, document?}], usage}."""
    return {"model": model, "usage": {"total_tokens": tokens},
            "results": [{"index": r.index, "relevance_score": r.score,
                         **({"document": {"text": p.documents[r.index]}} if p.return_documents else {})}
                        for r in ranked]}


def check_model(p: RerankParsed, settings: GatewaySettings) -> None:
    """/v1/rerank's `model` must name the served reranker."""
    if p.model != settings.rerank_model:
        raise unknown_model(p.model, (str(settings.rerank_model),))


def rerank_routes(gw: Any) -> list[tuple[Any, Any, str]]:
    """The two routes as (Operation, handler, metrics label) rows of app._routes' table; none without a reranker."""
    import orjson
    from starlette.requests import Request
    from starlette.responses import Response

    from bge_triton.gateway.openapi import Operation

    reranker: Reranker | None = gw.reranker
    if reranker is None:
        return []

    def _json(payload: Any) -> Response:
        return Response(orjson.dumps(payload), media_type="application/json")

    async def tei_rerank(request: Request, timing: dict[str, float]) -> Response:
        p = await reranker.parse(await gw.body(request), True, gw.parsers)
        priority = priority_of(request.headers.get("x-priority", ""), len(p.documents), gw.s, True)
        ranked, _ = await reranker.rank(p, priority, timing, True)
        return _json(tei_answer(p, ranked))

    async def cohere_rerank(request: Request, timing: dict[str, float]) -> Response:
        p = await reranker.parse(await gw.body(request), False, gw.parsers)
        check_model(p, gw.s)
        priority = priority_of(request.headers.get("x-priority", ""), len(p.documents), gw.s, False)
        ranked, tokens = await reranker.rank(p, priority, timing, False)
        return _json(cohere_answer(p, ranked, tokens, reranker.model))

    errors = ("invalid_json", "invalid", "too_long", "too_large", "not_found", "overloaded", "unavailable", "timeout",
              "backend", "internal")
    return [
        (Operation("/rerank", "POST", "TEI: rank texts by relevance to a query (the reranker)", TeiRerankResponse,
                   TeiRerankRequest, tei=True, timing=True, errors=errors), tei_rerank, "/rerank"),
        (Operation("/v1/rerank", "POST", "Cohere / Jina: rank documents by relevance to a query (the reranker)",
                   RerankResponse, RerankRequest, timing=True, errors=errors), cohere_rerank, "/v1/rerank"),
    ]

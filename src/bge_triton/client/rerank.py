"""The sans-I/O half of rerank(): one query and its documents as InferCalls to the reranker's text-pair endpoint
(bge_reranker: `query` BYTES [1, 1], `documents` BYTES [1, N] -> `score` FP32 [1, N], the raw logits), and the
answers turned into documents ranked by relevance. EmbeddingClient.rerank and AsyncEmbeddingClient.rerank add
the I/O.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bge_triton.client.core import DIRECTIONS, TIMING, TOKEN_COUNT, InferCall, Timing
from bge_triton.client.errors import InputError, KitError

__all__ = ["RERANK_MODEL", "MAX_DOCUMENTS_PER_REQUEST", "Ranked", "Reranked", "rerank_calls", "decode_scores",
           "ranked"]

RERANK_MODEL = "bge_reranker"
SCORE = "score"
# documents per request: far below the endpoint's admission limit (max_queue_size 2048 pairs per level), so a long
# list never fills one level of one instance by itself; longer lists go as several requests
MAX_DOCUMENTS_PER_REQUEST = 1000


@dataclass(frozen=True)
class Ranked:
    """One document of a rerank: its position in the documents given, its relevance (sigmoid of the logit, 0..1,
    as sentence-transformers' CrossEncoder and TEI report it) and the raw logit."""

    index: int
    score: float
    logit: float


@dataclass(frozen=True)
class Reranked:
    """rerank_with_timing's result: the ranking, the tokens of every pair as scored, and where the time went."""

    results: list[Ranked]
    total_tokens: int
    timing: Timing


def _utf8(text: str, what: str) -> bytes:
    if not isinstance(text, str):
        raise InputError(f"{what} is a {type(text).__name__}: pass a str")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what} is not valid UTF-8 text ({exc.reason} at position {exc.start}): fix the string "
                         "before sending") from None


def rerank_calls(model: str, query: str, documents: Sequence[str], truncate: bool = True,
                 direction: str | None = None, priority: int = 0, timing: bool = False,
                 timeout_s: float | None = None) -> list[tuple[InferCall, slice]]:
    """The requests of one rerank and the documents each carries (MAX_DOCUMENTS_PER_REQUEST at most); timing:
    ask for `timing_us` too; timeout_s: Triton's per-request timeout, so the pairs wait in the endpoint's queue as
    long as the caller waits (allow_timeout_override), not its 5 s default: a long list on a busy server is slow,
    not refused."""
    if isinstance(documents, str):
        raise InputError("documents is one str: pass a list of documents, e.g. [text]")
    if not documents:
        raise InputError("no documents to rerank: pass at least one document")
    if direction is not None and direction not in DIRECTIONS:
        raise InputError(f"truncation_direction={direction!r}: use 'right' (cut the end) or 'left' (cut the start)")
    q = np.empty((1, 1), dtype=np.object_)
    q[0, 0] = _utf8(query, "query")
    encoded = [_utf8(d, f"document {i}") for i, d in enumerate(documents)]
    parameters: dict[str, Any] = {"truncate": bool(truncate)}
    if direction is not None:
        parameters["truncation_direction"] = direction
    if priority:  # Triton's queue priority, and the same level for the endpoint's scheduler (priority_level)
        parameters["priority_level"] = int(priority)
    if timeout_s:  # Triton's reserved `timeout` request parameter (microseconds)
        parameters["timeout"] = int(timeout_s * 1e6)
    outputs = (SCORE, TOKEN_COUNT, *((TIMING,) if timing else ()))
    calls = []
    for start in range(0, len(encoded), MAX_DOCUMENTS_PER_REQUEST):
        part = slice(start, min(start + MAX_DOCUMENTS_PER_REQUEST, len(encoded)))
        docs = np.empty((1, part.stop - part.start), dtype=np.object_)
        docs[0, :] = encoded[part]
        calls.append((InferCall(model, (("query", "BYTES", q), ("documents", "BYTES", docs)), dict(parameters),
                                part.stop - part.start, priority=int(priority), outputs=outputs),
                      part))
    return calls


def decode_scores(result: Any, rows: int) -> tuple[NDArray[Any], NDArray[Any]]:
    """`score` (float32 [rows]) and `token_count` (int32 [rows]) of one answer, checked."""
    score = result.as_numpy(SCORE)
    if score is None or np.asarray(score).size != rows:
        raise KitError(f"the reranker answered {None if score is None else np.asarray(score).shape} for output "
                       f"'{SCORE}', expected [1, {rows}]: is the model a reranker (bge-triton export of a "
                       "cross-encoder)? Pass its name as rerank_model")
    counts = result.as_numpy(TOKEN_COUNT)
    counts = np.zeros(rows, np.int32) if counts is None else np.asarray(counts, np.int32).reshape(rows)
    return np.asarray(score, np.float32).reshape(rows), counts


def ranked(logits: NDArray[Any], top_n: int | None = None) -> list[Ranked]:
    """Documents by relevance, highest first (ties keep the input order); top_n keeps the first top_n."""
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise InputError(f"top_n={top_n!r}: pass a positive integer, or None for every document")
    order = np.argsort(-np.asarray(logits, np.float64), kind="stable")[:top_n]
    return [Ranked(int(i), 1.0 / (1.0 + math.exp(-float(logits[i]))), float(logits[i])) for i in order]

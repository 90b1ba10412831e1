"""The reranker routes' request and response bodies as pydantic models: the handlers validate with them and
/openapi.json is generated from them (gateway/openapi.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

__all__ = ["TeiRerankRequest", "TeiRank", "TeiRerankResponse", "CohereDocument", "RerankRequest", "RerankResult",
           "RerankUsage", "RerankResponse"]


class TeiRerankRequest(BaseModel):
    """POST /rerank: text-embeddings-inference's request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    query: str = Field(description="the query; never truncated")
    texts: list[str] = Field(description="the documents to rank (at least one)")
    raw_scores: bool = Field(False, description="true: the raw logit; false: its sigmoid (0..1)")
    return_text: bool = Field(False, description="echo each document as `text`")
    truncate: bool | None = Field(None, description="cut a document whose pair is over the token limit (default "
                                                    "false: refuse it)")
    truncation_direction: Literal["Right", "Left", "right", "left"] = Field(
        "Right", description="Right cuts the document's end, Left its start")


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None


class TeiRerankResponse(RootModel[list[TeiRank]]):
    """TEI's answer: the documents sorted by score, highest first."""


class CohereDocument(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(BaseModel):
    """POST /v1/rerank: Cohere's and Jina's request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="the served reranker's name (--rerank-model)")
    query: str
    documents: list[str | CohereDocument] = Field(description="strings, or objects with `text`")
    top_n: int | None = Field(None, ge=1, description="return the top_n best documents (default: all)")
    return_documents: bool = Field(False, description="echo each document in `document`")
    max_chunks_per_doc: int | None = Field(None, description="accepted for compatibility; documents are not "
                                                             "chunked (a long one is cut at the token limit)")


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: CohereDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    model: str
    results: list[RerankResult]
    usage: RerankUsage

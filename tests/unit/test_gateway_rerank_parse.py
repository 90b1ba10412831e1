"""The rerank routes' body checks and answer shapes (no server): TEI's and Cohere's fields, limits, priority."""
from __future__ import annotations

import orjson
import pytest

from bge_triton.client.rerank import Ranked, ranked
from bge_triton.gateway.errors import GatewayError
from bge_triton.gateway.rerank import QUERY_DOCUMENTS, cohere_answer, parse_rerank, priority_of, tei_answer
from bge_triton.gateway.settings import GatewaySettings


def body(**fields) -> bytes:
    return orjson.dumps(fields)


def test_tei_and_cohere_bodies_parse_to_one_request() -> None:
    t = parse_rerank(body(query="q", texts=["a", "b"], raw_scores=True, truncate=True, truncation_direction="Left"),
                     True, 10, 100)
    assert (t.documents, t.raw, t.truncate, t.direction, t.model) == (["a", "b"], True, True, "left", None)
    c = parse_rerank(body(model="m", query="q", documents=["a", {"text": "b", "id": 7}], top_n=1,
                          return_documents=True), False, 10, 100)
    assert (c.documents, c.top_n, c.return_documents, c.model, c.truncate) == (["a", "b"], 1, True, "m", True)


@pytest.mark.parametrize("tei, fields, status, words", [
    (True, {"query": "q"}, 422, "`texts` is required"),
    (True, {"query": "q", "texts": []}, 422, "`texts` is empty"),
    (False, {"model": "m", "query": "", "documents": ["a"]}, 400, "`query` is empty"),
    (False, {"model": "m", "query": "q", "documents": ["a", " "]}, 400, "`documents[1]` is empty"),
    (True, {"query": "q", "texts": ["a"] * 11}, 413, "the limit is 10"),
    (True, {"query": "q", "texts": ["a" * 101]}, 413, "over the limit of 100"),
    (True, {"query": "q", "texts": ["a"], "bogus": 1}, 422, "`bogus` is not a field"),
])
def test_bad_bodies_name_the_field_and_the_fix(tei, fields, status, words) -> None:
    with pytest.raises(GatewayError) as err:
        parse_rerank(body(**fields), tei, 10, 100)
    assert err.value.status_for(tei) == status and words in err.value.message


def test_a_long_document_is_cut_to_the_character_limit_when_truncating() -> None:
    p = parse_rerank(body(query="q", texts=["ab" * 100], truncate=True, truncation_direction="left"), True, 10, 100)
    assert p.documents == [("ab" * 100)[-100:]]


def test_answers_are_sorted_and_shaped_as_each_api() -> None:
    p = parse_rerank(body(query="q", texts=["a", "b", "c"], return_text=True), True, 10, 100)
    r = ranked([0.5, 2.0, -1.0])
    assert [x.index for x in r] == [1, 0, 2] and isinstance(r[0], Ranked)
    tei = tei_answer(p, r)
    assert [x["text"] for x in tei] == ["b", "a", "c"] and tei[0]["score"] == r[0].score
    cohere = cohere_answer(p, r[:2], 42, "m")
    assert cohere["usage"] == {"total_tokens": 42} and [x["index"] for x in cohere["results"]] == [1, 0]


def test_priority_small_reranks_are_queries_big_ones_bulk() -> None:
    s = GatewaySettings()
    assert priority_of("", QUERY_DOCUMENTS, s, True) == s.query_priority
    assert priority_of("", QUERY_DOCUMENTS + 1, s, True) == s.passage_priority
    assert priority_of("high", 5000, s, True) == s.query_priority
    with pytest.raises(GatewayError, match="use high or low"):
        priority_of("urgent", 1, s, True)

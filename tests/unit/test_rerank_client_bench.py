"""The SDK's sans-I/O rerank (requests, ranking) and the rerank bench's pure parts (documents, FIFO padding)."""
from __future__ import annotations

import numpy as np
import pytest

from bge_triton.client import InputError
from bge_triton.client.rerank import MAX_DOCUMENTS_PER_REQUEST, ranked, rerank_calls
from bge_triton.loadtest.rerank_bench import DOC_CHARS, documents, fifo_padding


def test_rerank_calls_carry_one_query_and_split_long_lists() -> None:
    docs = [f"d{i}" for i in range(MAX_DOCUMENTS_PER_REQUEST + 5)]
    calls = rerank_calls("r", "q", docs, truncate=False, direction="left", priority=1, timing=True)
    assert [c.rows for c, _ in calls] == [MAX_DOCUMENTS_PER_REQUEST, 5]
    call, part = calls[1]
    inputs = {name: arr for name, _, arr in call.inputs}
    assert inputs["query"].shape == (1, 1) and inputs["documents"].shape == (1, 5)
    assert list(inputs["documents"][0]) == [d.encode() for d in docs[part]]
    assert call.parameters == {"truncate": False, "truncation_direction": "left", "priority_level": 1}
    assert call.priority == 1 and call.outputs == ("score", "token_count", "timing_us")


@pytest.mark.parametrize("query, docs, words", [("q", [], "no documents"), ("q", "one text", "list of documents"),
                                                ("q", ["a"], None)])
def test_rerank_calls_refuse_what_cannot_be_sent(query, docs, words) -> None:
    if words is None:
        assert rerank_calls("r", query, docs)
        return
    with pytest.raises(InputError, match=words):
        rerank_calls("r", query, docs)


def test_ranked_sorts_by_logit_keeps_ties_in_order_and_cuts_top_n() -> None:
    r = ranked(np.array([0.0, 3.0, 0.0, -2.0], np.float32), top_n=3)
    assert [x.index for x in r] == [1, 0, 2]
    assert r[0].score == pytest.approx(1 / (1 + np.exp(-3.0))) and r[0].logit == 3.0
    with pytest.raises(InputError, match="top_n"):
        ranked(np.zeros(2), top_n=0)


def test_bench_documents_spread_over_200_to_500_characters() -> None:
    docs = documents(200, seed=1)
    lengths = [len(d) for d in docs]
    assert min(lengths) >= DOC_CHARS[0] and max(lengths) <= DOC_CHARS[1]
    assert np.std(lengths) > 50  # a spread, as a RAG splitter's chunks have
    assert documents(5, seed=1) == docs[:5]


def test_fifo_padding_pads_each_arrival_batch_to_its_longest() -> None:
    assert fifo_padding([10, 30, 20, 20], max_batch=2, multiple=8) == (80, 2 * 32 + 2 * 24, 2)

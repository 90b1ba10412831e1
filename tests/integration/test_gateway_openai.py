"""The gateway as a real process in front of the REAL local tritonserver (session fixture, MiniLM),
called with the official `openai` client: vectors equal to the SDK's, usage equal to the server
tokenizer's counts, every error with its status and JSON shape, keys (401 / 429), /ready."""
from __future__ import annotations

import base64
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx as httpx
import numpy as np
import openai as openai
import pytest
import starlette  # noqa: F401 - the extra this test needs
from tokenizers import Tokenizer

from bge_triton.client import EmbeddingClient

pytestmark = pytest.mark.integration

NAME, DIM, MAX_LENGTH = "minilm", 384, 256
KEY = "test-key-" + "x" * 24
WORDS = "retrieval vector index search query passage document cluster model server batch token".split()
REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS_100 = [f"Sentence {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 17))
             for i in range(100)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProc:
    """One gateway process; stopped by its pid."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "bge_triton.gateway", "--port", str(port), *args]
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._fh, stderr=subprocess.STDOUT)

    def wait(self, path: str = "/ready", timeout_s: float = 120.0) -> GatewayProc:
        """Poll `path` until it answers 200; fail with the log if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"gateway exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"gateway {path} not 200 within {timeout_s} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self._fh.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._fh.close()


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def sdk(triton_server: Any):
    with EmbeddingClient(triton_server.grpc_url, model=NAME) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(minilm_repo: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(minilm_repo / NAME / "1" / "tokenizer" / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_LENGTH)
    return tok


def start(tmp: Path, triton: str, repo: Path | None = None, *extra: str, wait: str = "/ready") -> GatewayProc:
    """A gateway with a Triton URL and a model name only (issue 25: no local tokenizer needed); repo, when
    given, is passed as the optional --model-repository."""
    port = free_port()
    local = ["--model-repository", str(repo)] if repo is not None else []
    proc = GatewayProc(["--triton", triton, "--model", NAME, *local, *extra], port, tmp / f"gateway-{port}.log")
    try:
        return proc.wait(wait)
    except BaseException:
        proc.stop()
        raise


@pytest.fixture(scope="module")
def gw(triton_server: Any, minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = start(tmp_path_factory.mktemp("gw"), triton_server.grpc_url, None,
                 "--served-model-name", "all-MiniLM-L6-v2", "--max-inputs", "128", "--max-body-bytes", "200000")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def oa(gw: GatewayProc):
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_one_string_float_equals_sdk(oa, sdk, tokenizer) -> None:
    text = "The cat sits on the mat."
    r = oa.embeddings.create(model=NAME, input=text, encoding_format="float")
    got = np.array(r.data[0].embedding, dtype=np.float32)
    assert got.shape == (DIM,) and r.model == NAME
    assert cosine(got, sdk.embed_documents([text])[0]) >= 0.9999
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(tokenizer.encode(text).ids)


def test_list_of_100_default_base64_equals_sdk(oa, sdk, tokenizer) -> None:
    r = oa.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS_100)  # the client asks for base64
    got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)], dtype=np.float32)
    assert got.shape == (100, DIM)
    assert cosine(got, sdk.embed_documents(TEXTS_100)).min() >= 0.9999
    assert r.usage.prompt_tokens == sum(len(e.ids) for e in tokenizer.encode_batch(TEXTS_100))


def test_concurrent_single_texts_each_get_their_own_vector(gw, sdk) -> None:
    """60 one-text requests at once share Triton calls (the gateway's micro-batcher): each caller
    still gets the vector of its own text."""
    import asyncio

    texts = TEXTS_100[:60]

    async def main() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(c.embeddings.create(model=NAME, input=t) for t in texts))

    results = asyncio.run(main())
    got = np.array([r.data[0].embedding for r in results], dtype=np.float32)
    assert cosine(got, sdk.embed_documents(texts)).min() >= 0.9999
    assert "gateway_triton_duration_seconds_count" in httpx.get(gw.url + "/metrics").text


def test_explicit_base64_is_little_endian_float32(gw, sdk) -> None:
    r = httpx.post(gw.url + "/v1/embeddings", json={"model": NAME, "input": ["hello", "world"],
                                                    "encoding_format": "base64"}, timeout=60)
    assert r.status_code == 200
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    assert cosine(got, sdk.embed_documents(["hello", "world"])).min() >= 0.9999
    for name in ("x-total-time", "x-tokenization-time", "x-inference-time"):  # the text endpoint's own split
        assert float(r.headers[name]) > 0
    assert float(r.headers["x-queue-time"]) >= 0
    assert float(r.headers["x-inference-time"]) < float(r.headers["x-total-time"])


def test_query_input_type_equals_sdk_queries(oa, sdk, tokenizer) -> None:
    q = "where does the cat sit"
    r = oa.embeddings.create(model=NAME, input=[q], encoding_format="float", extra_body={"input_type": "query"})
    assert cosine(np.array(r.data[0].embedding), sdk.embed_queries([q])[0]) >= 0.9999
    instruction = sdk.settings.query_instruction
    assert r.usage.prompt_tokens == len(tokenizer.encode(instruction + q).ids)


def test_truncate_none_start_end(oa, gw, sdk, tokenizer) -> None:
    tail = "The cat sits on the mat."
    long_text = "alpha " * 400 + tail
    full = Tokenizer.from_str(tokenizer.to_str())
    full.no_truncation()
    n = len(full.encode(long_text).ids)
    with pytest.raises(openai.BadRequestError) as info:
        oa.embeddings.create(model=NAME, input=long_text, extra_body={"truncate": "NONE"})
    err = info.value.body
    assert err["code"] == "context_length_exceeded" and f"has {n} tokens" in err["message"]
    assert f"limit is {MAX_LENGTH}" in err["message"]
    end = oa.embeddings.create(model=NAME, input=long_text, encoding_format="float", extra_body={"truncate": "END"})
    assert end.usage.prompt_tokens == MAX_LENGTH
    assert cosine(np.array(end.data[0].embedding), sdk.embed_documents([long_text])[0]) >= 0.9999
    start = oa.embeddings.create(model=NAME, input=long_text, encoding_format="float",
                                 extra_body={"truncate": "START"})
    assert start.usage.prompt_tokens <= MAX_LENGTH
    ref = sdk.embed_documents([tail])[0]  # START keeps the tail sentence, END only the leading alphas
    assert cosine(np.array(start.data[0].embedding), ref) > cosine(np.array(end.data[0].embedding), ref) + 0.05


def test_tei_embed_equals_sdk(gw, sdk) -> None:
    r = httpx.post(gw.url + "/embed", json={"inputs": ["hello", "world"]}, timeout=60)
    assert r.status_code == 200
    assert cosine(np.array(r.json()), sdk.embed_documents(["hello", "world"])).min() >= 0.9999


def test_tei_routes_accept_what_tei_accepts(gw, sdk) -> None:
    """Issue 25 finding 4: POST / is /embed; truncation_direction in either spelling cuts the start through the
    text endpoint; prompt_name query = the query instruction; an over-long text under truncate false is 413;
    what TEI could do but this model cannot (dimensions, normalize false) is a 422 naming the field."""
    tail = "The cat sits on the mat."
    long_text = "alpha " * 400 + tail
    root = httpx.post(gw.url + "/", json={"inputs": "hello"}, timeout=60)
    assert root.status_code == 200 and cosine(np.array(root.json()[0]), sdk.embed_documents(["hello"])[0]) >= 0.9999
    ref = sdk.embed_documents([tail])[0]
    sims = {}
    for direction in ("Left", "left", "Right", "right"):
        r = httpx.post(gw.url + "/embed", json={"inputs": [long_text], "truncate": True,
                                                "truncation_direction": direction}, timeout=60)
        assert r.status_code == 200, r.text
        sims[direction] = cosine(np.array(r.json()[0]), ref)
    assert abs(sims["Left"] - sims["left"]) < 1e-5 and abs(sims["Right"] - sims["right"]) < 1e-5
    assert sims["left"] > sims["right"] + 0.05  # the start was cut: the tail sentence stayed
    q = httpx.post(gw.url + "/embed", json={"inputs": ["where does the cat sit"], "prompt_name": "query"}, timeout=60)
    assert cosine(np.array(q.json()[0]), sdk.embed_queries(["where does the cat sit"])[0]) >= 0.9999
    r = httpx.post(gw.url + "/embed", json={"inputs": [long_text]}, timeout=60)
    assert r.status_code == 413 and r.json()["error_type"] == "Validation"
    assert f"limit is {MAX_LENGTH}" in r.json()["error"]
    for body, field in (({"inputs": "x", "dimensions": 8}, "dimensions"),
                        ({"inputs": "x", "normalize": False}, "normalize"),
                        ({"inputs": "x", "prompt_name": "summary"}, "prompt_name")):
        r = httpx.post(gw.url + "/embed", json=body, timeout=60)
        assert r.status_code == 422 and f"`{field}`" in r.json()["error"], r.text


def error_of(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


def test_errors_through_the_openai_client(oa) -> None:
    with pytest.raises(openai.BadRequestError, match="token id"):
        oa.embeddings.create(model=NAME, input=[[101, 7592, 102]])
    with pytest.raises(openai.BadRequestError, match="384-dimensional"):
        oa.embeddings.create(model=NAME, input="x", dimensions=128)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oa.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.APIStatusError) as info:
        oa.embeddings.create(model=NAME, input=["x"] * 129)
    assert info.value.status_code == 413
    assert [m.id for m in oa.models.list().data] == [NAME, "all-MiniLM-L6-v2"]


def test_error_shapes_over_raw_http(gw) -> None:
    post = lambda body, **kw: httpx.post(gw.url + "/v1/embeddings", timeout=60, **body, **kw)  # noqa: E731
    error_of(post({"content": b"{oops"}), 400, "invalid_json")
    assert error_of(post({"json": {"model": NAME, "input": ["ok", ""]}}), 400, "invalid_value")["param"] == "input"
    error_of(post({"json": {"model": NAME, "input": "x", "encoding_format": "int8"}}), 400, "invalid_value")
    error_of(post({"json": {"model": "nope", "input": "x"}}), 404, "model_not_found")
    error_of(post({"json": {"model": NAME, "input": ["y" * 2100] * 100}}), 413, "request_too_large")
    assert httpx.post(gw.url + "/v1/embeddings", json={"model": NAME, "input": "still fine"},
                      timeout=60).status_code == 200  # bad requests left the gateway untouched
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'gateway_requests_total{route="/v1/embeddings",status="413"}' in metrics


def test_keys_401_and_rate_limit_429(triton_server, minilm_repo, tmp_path) -> None:
    proc = start(tmp_path, triton_server.grpc_url, None, "--api-key", KEY, "--rate-limit", "0.05",
                 "--rate-burst", "3")
    try:
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="wrong-key", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.embeddings.create(model=NAME, input="x")
        error_of(httpx.get(proc.url + "/v1/models"), 401, "invalid_api_key")
        with openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0) as good:
            assert len(good.embeddings.create(model=NAME, input="x").data) == 1
            good.models.list()
            good.models.list()
            with pytest.raises(openai.RateLimitError) as info:  # the 4th request within 20 s
                good.models.list()
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["code"] == "rate_limit_exceeded"
        assert httpx.get(proc.url + "/ready").status_code == 200  # ops routes need no key
    finally:
        proc.stop()


def test_triton_unreachable_is_503_with_retry_after(minilm_repo, tmp_path) -> None:
    """503 + Retry-After in the API's words: Triton's address stays in the gateway's log (issue 25 finding 2;
    this test used to look for the SDK's 'tritonserver' hint in the body)."""
    triton = f"127.0.0.1:{free_port()}"
    proc = start(tmp_path, triton, None, "--timeout", "2", wait="/health")
    try:
        r = httpx.post(proc.url + "/v1/embeddings", json={"model": NAME, "input": "x"}, timeout=60)
        err = error_of(r, 503, "triton_unavailable")
        assert int(r.headers["retry-after"]) >= 1 and "unreachable" in err["message"]
        assert triton not in r.text and "127.0.0.1" not in r.text
        ready = httpx.get(proc.url + "/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "not ready"
    finally:
        proc.stop()


def test_sdk_embed_with_timing_against_the_text_endpoint(sdk, tokenizer) -> None:
    """The SDK's sibling of embed_with_counts: the text endpoint's tokenization / queue / inference split and
    the call's total; truncation_direction "left" keeps the end of a long text (the gateway's START)."""
    tail = "The cat sits on the mat."
    long_text = "alpha " * 400 + tail
    timed = sdk.embed_with_timing(["hello world", long_text], truncation_direction="left")
    assert timed.vectors.shape == (2, DIM) and timed.token_counts.tolist() == [4, MAX_LENGTH]
    t = timed.timing
    assert t.tokenization_s > 0 and t.inference_s > 0 and t.queue_s >= 0
    assert t.tokenization_s + t.queue_s + t.inference_s <= t.total_s
    ref = sdk.embed_documents([tail])[0]
    right = sdk.embed_with_timing([long_text], truncation_direction="right").vectors[0]
    assert cosine(timed.vectors[1], ref) > cosine(right, ref) + 0.05

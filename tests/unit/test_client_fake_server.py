"""Sync and async clients end to end against an in-process FAKE Triton gRPC service (no tritonserver):
order, splitting at max_batch_size, queries, retry on a full queue, error types, timeouts, CLI."""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bge_triton.client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InputError,
    ModelConfigError,
    Overloaded,
    RetryPolicy,
    ServerUnavailable,
)
from bge_triton.client.cli import main as cli_main

DIM = 4
CONFIG = f"""
name: "fake" backend: "python" max_batch_size: 4
input {{ name: "text" data_type: TYPE_STRING dims: 1 }}
output {{ name: "embedding" data_type: TYPE_FP32 dims: {DIM} }}
output {{ name: "token_count" data_type: TYPE_INT32 dims: 1 }}
"""


def free_port() -> int:
    for port in range(18000, 18100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 18000-18099")


def fake_count(text: str) -> int:
    return len(text.split()) + 2  # words + [CLS] + [SEP]: the fake server's token count


def fake_vector(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)) % 997), 1.0, 0.0]


def decode_bytes(raw: bytes) -> list[str]:
    out, i = [], 0
    while i < len(raw):
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4:i + 4 + n].decode("utf-8"))
        i += 4 + n
    return out


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.failures: list[tuple[grpc.StatusCode, str]] = []
        self.requests: list[tuple[list[str], bool]] = []
        self.outputs: list[tuple[list[str], int]] = []  # (requested outputs, priority) per request
        self.hold = threading.Event()  # cleared: every ModelInfer waits (bounded) until it is set again
        self.hold.set()
        self.in_infer = 0
        self.lock = threading.Condition()

    def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name == "fake")

    def ModelConfig(self, request, context):
        if request.name != "fake":
            context.abort(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{request.name}' is not found")
        return service_pb2.ModelConfigResponse(config=text_format.Parse(CONFIG, mc.ModelConfig()))

    def ModelInfer(self, request, context):
        with self.lock:
            failure = self.failures.pop(0) if self.failures else None
        if failure:
            context.abort(*failure)
        with self.lock:
            self.in_infer += 1
        try:
            assert self.hold.wait(60), "the test never released ModelInfer"
        finally:
            with self.lock:
                self.in_infer -= 1
                self.lock.notify_all()
        texts = decode_bytes(request.raw_input_contents[0])
        truncate = request.parameters["truncate"].bool_param
        outputs = [o.name for o in request.outputs]
        with self.lock:
            self.requests.append((texts, truncate))
            self.outputs.append((outputs, request.parameters["priority"].uint64_param))
        if any("TOO LONG" in t for t in texts) and not truncate:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text has 900 tokens, the limit is 512")
        resp = service_pb2.ModelInferResponse(model_name="fake")
        resp.outputs.add(name="embedding", datatype="FP32", shape=[len(texts), DIM])
        resp.raw_output_contents.append(np.array([fake_vector(t) for t in texts], np.float32).tobytes())
        if "token_count" in outputs:
            resp.outputs.add(name="token_count", datatype="INT32", shape=[len(texts), 1])
            resp.raw_output_contents.append(np.array([[fake_count(t)] for t in texts], "<i4").tobytes())
        return resp


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeTriton, str]]:
    servicer = FakeTriton()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0).wait()


FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05, total_s=60.0)  # total: a hang bound


def test_sync_order_split_and_queries(fake) -> None:
    servicer, url = fake
    servicer.requests.clear()
    texts = [f"doc {i}" for i in range(10)]
    with EmbeddingClient(url, model="fake", retry=FAST, query_instruction="Q: ") as c:
        assert (c.dim, c.spec.max_batch_size) == (DIM, 4)
        out = c.embed_documents(texts)
        q = c.embed_queries(["hi"])
        empty = c.embed_documents([])
    assert out.dtype == np.float32 and out.shape == (10, DIM)
    np.testing.assert_array_equal(out, [fake_vector(t) for t in texts])
    np.testing.assert_array_equal(q[0], fake_vector("Q: hi"))
    assert empty.shape == (0, DIM)
    assert [len(t) for t, _ in servicer.requests] == [4, 4, 2, 1]


def test_async_equals_sync(fake) -> None:
    _, url = fake
    texts = [f"文本 {i}" for i in range(9)]

    async def main() -> np.ndarray:
        async with AsyncEmbeddingClient(url, model="fake", retry=FAST) as c:
            return await c.embed_documents(texts)

    with EmbeddingClient(url, model="fake") as c:
        np.testing.assert_array_equal(asyncio.run(main()), c.embed_documents(texts))


def test_token_counts_sync_async_split_and_priority(fake) -> None:
    """embed_with_counts asks for token_count only when called, keeps input order across split requests,
    and the async client's priority reaches the server."""
    servicer, url = fake
    texts = [f"doc {'w ' * i}{i}" for i in range(9)]  # 3 requests at max_batch_size 4
    want = [fake_count(t) for t in texts]

    async def main() -> tuple:
        async with AsyncEmbeddingClient(url, model="fake", retry=FAST, query_instruction="Q: ") as c:
            plain = await c.embed_documents(texts[:2], priority=1)
            return plain, await c.embed_with_counts(texts, priority=2), await c.embed_with_counts(["a b"], query=True)

    servicer.outputs.clear()
    plain, got, query = asyncio.run(main())
    assert [o for o, _ in servicer.outputs] == [["embedding"]] + [["embedding", "token_count"]] * 4
    assert [p for _, p in servicer.outputs] == [1, 2, 2, 2, 0]
    np.testing.assert_array_equal(got.vectors, [fake_vector(t) for t in texts])
    assert got.token_counts.dtype == np.int32 and got.token_counts.tolist() == want
    np.testing.assert_array_equal(plain, got.vectors[:2])
    assert query.token_counts.tolist() == [fake_count("Q: a b")]
    with EmbeddingClient(url, model="fake", retry=FAST) as c:
        vectors, counts = c.embed_with_counts(texts)
    np.testing.assert_array_equal(vectors, got.vectors)
    assert counts.tolist() == want


def test_retry_on_full_queue_then_success(fake) -> None:
    servicer, url = fake
    servicer.failures[:] = [(grpc.StatusCode.UNAVAILABLE, "Exceeds maximum queue size")] * 2
    with EmbeddingClient(url, model="fake", retry=FAST) as c:
        assert c.embed_documents(["x"]).shape == (1, DIM)
    assert servicer.failures == []


def test_overloaded_after_bounded_retries(fake) -> None:
    servicer, url = fake
    servicer.failures[:] = [(grpc.StatusCode.UNAVAILABLE, "Exceeds maximum queue size")] * 10
    with EmbeddingClient(url, model="fake", retry=FAST) as c:
        with pytest.raises(Overloaded, match="gave up after 4 attempts"):
            c.embed_documents(["x"])
    servicer.failures.clear()


def test_input_error_not_retried(fake) -> None:
    servicer, url = fake
    servicer.requests.clear()
    with EmbeddingClient(url, model="fake", retry=FAST, truncate=False) as c:
        with pytest.raises(InputError, match="900 tokens"):
            c.embed_documents(["TOO LONG"])
        assert len(servicer.requests) == 1
        assert c.embed_documents(["TOO LONG"], truncate=True).shape == (1, DIM)
        with pytest.raises(InputError, match="empty"):
            c.embed_documents([""])


def test_model_config_errors(fake) -> None:
    _, url = fake
    with pytest.raises(ModelConfigError, match="unknown model"):
        EmbeddingClient(url, model="nope", retry=FAST).connect()
    with pytest.raises(ModelConfigError, match="input_ids"):
        EmbeddingClient(url, model="fake", mode="tensor", tokenizer="x", retry=FAST)._accept_config(
            text_format.Parse(CONFIG.replace('"fake"', '"fake_onnx"'), mc.ModelConfig()), None)
    with pytest.raises(ModelConfigError, match="expects 1024"):
        with EmbeddingClient(url, model="fake", expected_dim=1024):
            pass


def test_timeout_is_per_call_and_not_retried(fake) -> None:
    """The server holds the call (no answer at all until the test lets it go): the call's own 0.1 s deadline
    ends it, and the message says it was not retried (a retried call says "gave up after N attempts")."""
    servicer, url = fake
    servicer.requests.clear()
    servicer.hold.clear()
    try:
        with EmbeddingClient(url, model="fake", retry=FAST) as c:
            with pytest.raises(ServerUnavailable, match="timeout_s=0.1") as info:
                c.embed_documents(["slow"], timeout_s=0.1)
            assert "gave up" not in str(info.value) and "retry budget" not in str(info.value)
    finally:
        servicer.hold.set()
        with servicer.lock:  # the held call leaves before the next test looks at servicer.requests
            assert servicer.lock.wait_for(lambda: servicer.in_infer == 0, 30)


def test_health_and_cli(fake, capsys) -> None:
    _, url = fake
    with EmbeddingClient(url, model="fake") as c:
        report = c.health()
    assert report["ok"] and report["model_ready"] and report["dim"] == DIM
    assert cli_main(["embed", "--url", url, "--model", "fake", "a", "bb"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["text"] for x in lines] == ["a", "bb"] and lines[1]["embedding"] == fake_vector("bb")
    assert cli_main(["health", "--url", url, "--model", "fake"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_micro_batcher_over_async_client(fake) -> None:
    _, url = fake

    async def main() -> None:
        async with AsyncEmbeddingClient(url, model="fake", retry=FAST) as c:
            async with c.micro_batcher(max_batch=32, max_wait_s=0.002) as mb:
                assert mb.max_batch == 4  # clamped to the server's max_batch_size
                texts = [f"caller {i}" for i in range(50)]
                results = await asyncio.gather(*(mb.embed(t) for t in texts))
        for text, vec in zip(texts, results, strict=True):
            assert vec.tolist() == fake_vector(text)

    asyncio.run(main())


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_connection_refused_is_server_unavailable(protocol: str) -> None:
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, total_s=3.0)
    with pytest.raises(ServerUnavailable, match="gave up after 2 attempts"):
        EmbeddingClient(url, model="fake", protocol=protocol, retry=policy, timeout_s=1.0).connect()

    async def main() -> None:
        async with AsyncEmbeddingClient(url, model="fake", protocol=protocol, retry=policy, timeout_s=1.0):
            pass

    with pytest.raises(ServerUnavailable):
        asyncio.run(main())


@pytest.mark.parametrize("protocol", ["http"])
def test_http_timeout_against_silent_server(protocol: str) -> None:
    sock = socket.socket()
    port = free_port()
    sock.bind(("127.0.0.1", port))
    sock.listen(8)  # accepts TCP, never answers
    try:  # the server never answers: only the client's own timeout (named in the message) can end the call
        with pytest.raises(ServerUnavailable, match="timeout_s=0.3"):
            EmbeddingClient(f"127.0.0.1:{port}", model="fake", protocol=protocol, timeout_s=0.3).connect()

        async def main() -> None:
            async with AsyncEmbeddingClient(f"127.0.0.1:{port}", model="fake", protocol=protocol, timeout_s=0.3):
                pass

        with pytest.raises(ServerUnavailable, match="timeout_s=0.3"):
            asyncio.run(main())
    finally:
        sock.close()

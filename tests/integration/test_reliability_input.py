"""Issue 7, bad input on a REAL tritonserver: every case of loadtest.bad_input's catalogue over gRPC and HTTP,
the kit client (sync/async x gRPC/HTTP) on the same inputs, bad requests failing alone inside one
Triton batch, and a bounded flood of bad requests that must leave the server's RSS bounded."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from bge_triton.client import AsyncEmbeddingClient, EmbeddingClient, InputError, ModelConfigError, RetryPolicy
from bge_triton.loadtest.bad_input import ALL_CASES, flood, raw_client, raw_infer, run_catalogue, text_array
from bge_triton.loadtest.faults import PORT_RANGE
from bge_triton.loadtest.harness import start_server
from bge_triton.repository import Batching, load_config, write_config
from bge_triton.server.cpu_variant import CpuVariant

pytestmark = pytest.mark.integration
NAME, HELD = "minilm", "minilmheld"
FLOOD = int(os.environ.get("KIT_RELIABILITY_FLOOD", "1500"))  # `bge-triton chaos` sends 10k
RSS_BOUND_MB = 64.0


def _repo_with_held_endpoint(src: Path, out: Path) -> Path:
    """src's models (symlinked) plus HELD: a second text endpoint on the same encoder whose batcher
    waits for 6 requests, so six concurrent requests are ONE Triton batch."""
    for name in (NAME, f"{NAME}_onnx"):
        (out / name).symlink_to(src / name)
    (out / HELD / "1").mkdir(parents=True)
    for item in (src / NAME / "1").iterdir():
        (out / HELD / "1" / item.name).symlink_to(item.resolve())
    cfg = load_config(src / NAME)
    cfg.name = HELD
    write_config(cfg, out / HELD / "config.pbtxt", "tests/integration/test_reliability_input.py")
    return out


@pytest.fixture(scope="module")
def server(minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory):
    repo = _repo_with_held_endpoint(minilm_repo, tmp_path_factory.mktemp("rel_repo"))
    # the batcher fires when the sixth request is queued (preferred size 6): the 60 s delay and queue timeout only
    # bound a run that never gets there, so a slow machine spreads the six arrivals without splitting the batch
    held = Batching(preferred_batch_sizes=(6,), max_queue_delay_us=60_000_000, queue_timeout_us=60_000_000)
    variant = CpuVariant(batching={HELD: held})
    srv = start_server(repo, tmp_path_factory.mktemp("rel_state"), variant, port_range=PORT_RANGE)
    yield srv
    srv.stop()


def _healthy(srv) -> bool:
    client = raw_client("http", srv.http_url)
    out = raw_infer(client, NAME, [("text", "BYTES", text_array(["still alive"]))])
    return client.ready(None, 30.0) and client.ready(f"{NAME}_onnx", 30.0) and out.ok


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_every_bad_input_gets_a_clear_answer(server, protocol: str) -> None:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    rows = run_catalogue({protocol: url}, NAME)
    assert len(rows) == len(ALL_CASES)
    problems = [r["problem"] for r in rows if r["problem"]]
    assert not problems, "\n".join(problems)
    assert _healthy(server)


KIT_CASES = [  # (texts, truncate, expected exception or None, message substring, rows)
    ([""], None, InputError, "empty or whitespace", 0),
    (["  \u3000\t"], None, InputError, "empty or whitespace", 0),
    (["abc\x00def"], None, InputError, "NUL byte", 0),
    (["向量检索" * 25_000], None, None, "", 1),  # 100k chars: truncated (the documented default)
    (["向量检索" * 25_000], False, InputError, "over the limit", 0),
    (["𠀀𠀁𪚥𠮷", "😀🚀👍🏽👨‍👩‍👧"], None, None, "", 2),
    (["好的", "abc\x00"], None, InputError, "text 1 contains a NUL", 0),
    (["短文本"] * 200, None, None, "", 200),  # over max_batch_size 128: the client splits it
    (["x\ud800y"], None, InputError, "UTF-8", 0),
]


def _check_kit(result, expected, message: str, rows: int) -> None:
    if expected is None:
        assert isinstance(result, np.ndarray), result
        assert result.shape == (rows, 384) and np.isfinite(result).all()
    else:
        assert isinstance(result, expected), repr(result)
        assert message in str(result), str(result)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("texts,truncate,expected,message,rows", KIT_CASES)
def test_kit_client_sync(server, protocol, texts, truncate, expected, message, rows) -> None:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with EmbeddingClient(url, model=NAME, protocol=protocol, retry=RetryPolicy.off(), timeout_s=60) as c:
        try:
            result = c.embed_documents(texts, truncate=truncate)
        except Exception as exc:
            result = exc
    _check_kit(result, expected, message, rows)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_kit_client_async_all_cases(server, protocol) -> None:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    cases = KIT_CASES

    async def main():
        async with AsyncEmbeddingClient(url, model=NAME, protocol=protocol, retry=RetryPolicy.off(),
                                        timeout_s=60) as c:
            return await asyncio.gather(*(c.embed_documents(t, truncate=tr) for t, tr, *_ in cases),
                                        return_exceptions=True)

    for (_texts, _truncate, expected, message, rows), result in zip(cases, asyncio.run(main()), strict=True):
        _check_kit(result, expected, message, rows)
    assert _healthy(server)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unknown_model_is_a_config_error(server, protocol) -> None:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with pytest.raises(ModelConfigError, match="unknown model|not found"):
        EmbeddingClient(url, model="no_such_model", protocol=protocol, retry=RetryPolicy.off()).connect()

    async def main():
        async with AsyncEmbeddingClient(url, model="no_such_model", protocol=protocol, retry=RetryPolicy.off()):
            pass

    with pytest.raises(ModelConfigError):
        asyncio.run(main())


def test_bad_requests_fail_alone_in_one_triton_batch(server) -> None:
    import tritonclient.grpc as grpcclient

    payloads = [["今天天气很好"], [""], [b"\xff\xfe"], ["a\x00b"], ["𠀀😀"], ["hello world"]]
    stats = grpcclient.InferenceServerClient(server.grpc_url)

    def batches() -> dict[int, int]:
        s = stats.get_inference_statistics(HELD, as_json=True)["model_stats"][0]
        return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s.get("batch_stats", [])}

    before = batches()

    # every client connected before any request goes, so the six arrivals are not spread by channel set-up
    clients = [raw_client("grpc", server.grpc_url) for _ in payloads]
    assert all(c.ready(HELD, 30.0) for c in clients)
    go = threading.Barrier(len(payloads))

    def send(client, texts):
        go.wait()
        return raw_infer(client, HELD, [("text", "BYTES", text_array(texts))])

    with cf.ThreadPoolExecutor(len(payloads)) as pool:
        outs = list(pool.map(send, clients, payloads))
    after = batches()
    assert sum(after.values()) - sum(before.values()) == 1, (before, after)  # ONE Triton batch
    assert [o.ok for o in outs] == [True, False, False, False, True, True], [o.message for o in outs]
    assert [o.rows for o in outs if o.ok] == [1, 1, 1]
    assert "empty" in outs[1].message and "UTF-8" in outs[2].message and "NUL" in outs[3].message
    assert _healthy(server)


def test_bad_request_flood_leaves_rss_bounded(server) -> None:
    result = flood(server.grpc_url, NAME, server.proc.pid, FLOOD)
    assert result["lost"] == 0 and not result["problems"], result
    assert result["rss_growth_mb"] < RSS_BOUND_MB, result
    assert _healthy(server)

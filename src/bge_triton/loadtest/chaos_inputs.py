"""Bad-input catalogue for the text endpoint (NAME) and the encoder (NAME_onnx), and the flood that
sends thousands of them while watching the server's memory.

Each case says what the server must answer: "ok" (rows come back; over-long text is truncated, the
documented default) or an error status plus a substring of the message that names the problem.
Requests go through the SDK's transport below the kit client (which would refuse to build most of them), so the
server's own checks are what is tested; outcomes are labelled by errors.kind_of of their status.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tritonclient.utils import InferenceServerException

from bge_triton.client.core import InferCall
from bge_triton.client.transport import GrpcSync, HttpSync
from bge_triton.errors import kind_of
from bge_triton.loadtest.loadgen import closed_loop
from bge_triton.loadtest.stats import tree_rss_mb


@dataclass
class RawOutcome:
    """What one raw request ended in: ok (rows), or an error with its status and message."""

    ok: bool
    status: str = ""
    message: str = ""
    rows: int = 0
    seconds: float = 0.0


def raw_client(protocol: str, url: str) -> GrpcSync | HttpSync:
    """The SDK's own transport (client.transport: the kit's request bytes), without the client's input checks."""
    return GrpcSync(url) if protocol == "grpc" else HttpSync(url)


def raw_infer(client: GrpcSync | HttpSync, model: str, inputs: Sequence[tuple[str, str, np.ndarray]],
              parameters: dict | None = None, timeout_s: float = 30.0) -> RawOutcome:
    """Send named (name, datatype, array) inputs; never raises for a server answer."""
    call = InferCall(model, tuple(inputs), dict(parameters or {}), rows=len(inputs[0][2]) if inputs else 0)
    start = time.monotonic()
    try:
        emb = client.infer(call, timeout_s).as_numpy("embedding")
        return RawOutcome(True, rows=0 if emb is None else int(emb.shape[0]), seconds=time.monotonic() - start)
    except InferenceServerException as exc:
        return RawOutcome(False, str(exc.status() or ""), exc.message() or str(exc), seconds=time.monotonic() - start)


def text_array(texts: Sequence[str | bytes]) -> np.ndarray:
    """BYTES [n, 1]; str items are UTF-8 encoded, bytes items go as they are (invalid UTF-8 too)."""
    items = [t if isinstance(t, bytes) else t.encode("utf-8", "surrogatepass") for t in texts]
    return np.array(items, dtype=np.object_).reshape(-1, 1)


@dataclass(frozen=True)
class Case:
    """One bad (or unusual) input and what the server must answer."""

    name: str
    target: str  # "text" (NAME), "tensor" (NAME_onnx) or "unknown" (a model that does not exist)
    build: Callable[[], list[tuple[str, str, np.ndarray]]]
    expect: str  # "ok", or the errors.kind_of of the status the server must answer with
    message: str = ""  # substring of the error message (case-insensitive)
    parameters: dict | None = None


def _text(*texts: str | bytes) -> Callable[[], list[tuple[str, str, np.ndarray]]]:
    return lambda: [("text", "BYTES", text_array(texts))]


def _tensor(ids, mask=None, dtype: str = "INT64", np_dtype=np.int64):
    def build():
        a = np.asarray(ids, dtype=np_dtype)
        m = np.ones_like(a) if mask is None else np.asarray(mask, dtype=np_dtype)
        return [("input_ids", dtype, a), ("attention_mask", dtype, m)]
    return build


GOOD_IDS = [[101, 7592, 2088, 102]]
TEXT_CASES = [
    Case("empty", "text", _text(""), "InputError", "empty or whitespace"),
    Case("whitespace", "text", _text(" \t\n\u3000 "), "InputError", "empty or whitespace"),
    Case("nul_byte", "text", _text("abc\x00def"), "InputError", "NUL byte"),
    Case("invalid_utf8", "text", _text(b"\xff\xfe\xfdabc"), "InputError", "not valid UTF-8"),
    Case("lone_surrogate", "text", _text("x\ud800y"), "InputError", "not valid UTF-8"),
    Case("text_100k_truncated", "text", _text("向量检索" * 25_000), "ok"),
    Case("text_100k_truncate_false", "text", _text("向量检索" * 25_000), "InputError", "over the limit",
         {"truncate": False}),
    Case("cjk_extension_b", "text", _text("𠀀𠀁𠀂𪚥𠮷野家"), "ok"),
    Case("emoji", "text", _text("😀🚀👍🏽 家族👨‍👩‍👧"), "ok"),
    Case("good_and_bad_in_one_request", "text", _text("今天天气很好", "", "ok"), "InputError", "text 1 is empty"),
    Case("text_batch_over_max_batch_size", "text", _text(*["短文本"] * 200), "InputError", "batch-size must be <="),
]
TENSOR_CASES = [
    Case("int32_ids", "tensor", _tensor(GOOD_IDS, dtype="INT32", np_dtype=np.int32), "InputError", "data-type"),
    Case("fp32_ids", "tensor", _tensor(GOOD_IDS, dtype="FP32", np_dtype=np.float32), "InputError", "data-type"),
    Case("rank3_shape", "tensor", lambda: [("input_ids", "INT64", np.ones((1, 1, 4), np.int64)),
                                           ("attention_mask", "INT64", np.ones((1, 1, 4), np.int64))],
         "InputError", "unexpected shape"),
    Case("ids_mask_shape_mismatch", "tensor", _tensor(GOOD_IDS, [[1, 1, 1, 1, 1]]), "InputError", "!= attention_mask"),
    Case("token_id_over_vocab", "tensor", _tensor([[101, 10_000_000, 102]]), "InputError", "outside the vocabulary"),
    Case("negative_token_id", "tensor", _tensor([[101, -7, 102]]), "InputError", "outside the vocabulary"),
    Case("mask_all_zero", "tensor", _tensor(GOOD_IDS, [[0, 0, 0, 0]]), "InputError", "no real token"),
    Case("mask_not_binary", "tensor", _tensor(GOOD_IDS, [[1, 5, 1, 1]]), "InputError", "only 0 and 1"),
    Case("zero_length", "tensor", _tensor(np.zeros((1, 0))), "InputError", "seq_len >= 1"),
    Case("missing_mask", "tensor", lambda: [("input_ids", "INT64", np.asarray(GOOD_IDS, np.int64))],
         "InputError", "missing required input"),
    Case("tensor_batch_over_max_batch_size", "tensor", _tensor(np.repeat(GOOD_IDS, 100, axis=0)), "InputError",
         "batch-size must be <="),
    Case("good_tensor", "tensor", _tensor(GOOD_IDS), "ok"),
]
UNKNOWN_CASES = [Case("unknown_model", "unknown", _text("hello"), "ModelConfigError", "unknown model")]
ALL_CASES = TEXT_CASES + TENSOR_CASES + UNKNOWN_CASES


def target_model(case: Case, model: str) -> str:
    return {"text": model, "tensor": f"{model}_onnx", "unknown": f"{model}_does_not_exist"}[case.target]


def check(case: Case, outcome: RawOutcome) -> str | None:
    """None when the server answered as the case requires, else what was wrong."""
    got = "ok" if outcome.ok else kind_of(outcome.status)
    if got != case.expect or case.message.lower() not in outcome.message.lower():
        return f"{case.name}: expected {case.expect} '{case.message}', got {got} ({outcome.status}) '{outcome.message}'"
    return None


def run_catalogue(urls: dict[str, str], model: str, cases: Sequence[Case] = ALL_CASES) -> list[dict]:
    """Every case over every protocol in `urls` ({"grpc": url, "http": url}); one row per (case, protocol)."""
    rows = []
    for protocol, url in urls.items():
        client = raw_client(protocol, url)
        for case in cases:
            out = raw_infer(client, target_model(case, model), case.build(), case.parameters)
            rows.append({"case": case.name, "target": case.target, "protocol": protocol, "ok": out.ok,
                         "status": out.status, "message": out.message[:160], "seconds": round(out.seconds, 4),
                         "problem": check(case, out)})
        client.close()
    return rows


def flood(grpc_url: str, model: str, pid: int, requests: int, workers: int = 4) -> dict:
    """Send `requests` bad requests (cycling through the error cases) from `workers` closed-loop users; report the
    server's RSS before and after."""
    cases = [c for c in ALL_CASES if c.expect != "ok" and c.name != "text_100k_truncate_false"]
    clients = [raw_client("grpc", grpc_url) for _ in range(workers)]
    for case in cases * 3:  # first touches allocate caches: not a leak
        raw_infer(clients[0], target_model(case, model), case.build(), case.parameters)
    time.sleep(0.5)
    rss_before = tree_rss_mb(pid)
    kinds: Counter = Counter()
    problems: list[str] = []
    sent = [0]

    async def send(k: int) -> None:
        case = cases[sent[0] % len(cases)]
        sent[0] += 1
        out = await asyncio.to_thread(raw_infer, clients[k], target_model(case, model), case.build(), case.parameters)
        kinds[kind_of(out.status)] += 1
        if (bad := check(case, out)) and len(problems) < 5:
            problems.append(bad)

    start = time.monotonic()
    asyncio.run(closed_loop(send, workers, lambda: sent[0] >= requests))
    seconds = time.monotonic() - start
    time.sleep(0.5)
    rss_after = tree_rss_mb(pid)
    for c in clients:
        c.close()
    return {"requests": sent[0], "answered": sum(kinds.values()), "lost": sent[0] - sum(kinds.values()),
            "statuses": dict(kinds), "problems": problems, "seconds": seconds,
            "rss_before_mb": rss_before, "rss_after_mb": rss_after, "rss_growth_mb": rss_after - rss_before}

"""Bad-input catalogue for the text endpoint (NAME) and the encoder (NAME_onnx), and the flood that
sends thousands of them while watching the server's memory.

Each case says what the server must answer: "ok" (rows come back; over-long text is truncated, the
documented default) or an error status plus a substring of the message that names the problem.
Raw tritonclient requests are used, so the server's own checks are what is tested.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bge_triton.loadtest.chaos_common import raw_client, raw_infer, text_array, tree_rss_mb

INVALID = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}
NOT_FOUND = {"grpc": "StatusCode.NOT_FOUND", "http": "404"}


@dataclass(frozen=True)
class Case:
    """One bad (or unusual) input and what the server must answer."""

    name: str
    target: str  # "text" (NAME), "tensor" (NAME_onnx) or "unknown" (a model that does not exist)
    build: Callable[[], list[tuple[str, str, np.ndarray]]]
    expect: str  # "ok" or "invalid" or "not_found"
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
    Case("empty", "text", _text(""), "invalid", "empty or whitespace"),
    Case("whitespace", "text", _text(" \t\n\u3000 "), "invalid", "empty or whitespace"),
    Case("nul_byte", "text", _text("abc\x00def"), "invalid", "NUL byte"),
    Case("invalid_utf8", "text", _text(b"\xff\xfe\xfdabc"), "invalid", "not valid UTF-8"),
    Case("lone_surrogate", "text", _text("x\ud800y"), "invalid", "not valid UTF-8"),
    Case("text_100k_truncated", "text", _text("向量检索" * 25_000), "ok"),
    Case("text_100k_truncate_false", "text", _text("向量检索" * 25_000), "invalid", "over the limit",
         {"truncate": False}),
    Case("cjk_extension_b", "text", _text("𠀀𠀁𠀂𪚥𠮷野家"), "ok"),
    Case("emoji", "text", _text("😀🚀👍🏽 家族👨‍👩‍👧"), "ok"),
    Case("good_and_bad_in_one_request", "text", _text("今天天气很好", "", "ok"), "invalid", "text 1 is empty"),
    Case("text_batch_over_max_batch_size", "text", _text(*["短文本"] * 200), "invalid", "batch-size must be <="),
]
TENSOR_CASES = [
    Case("int32_ids", "tensor", _tensor(GOOD_IDS, dtype="INT32", np_dtype=np.int32), "invalid", "data-type"),
    Case("fp32_ids", "tensor", _tensor(GOOD_IDS, dtype="FP32", np_dtype=np.float32), "invalid", "data-type"),
    Case("rank3_shape", "tensor", lambda: [("input_ids", "INT64", np.ones((1, 1, 4), np.int64)),
                                           ("attention_mask", "INT64", np.ones((1, 1, 4), np.int64))],
         "invalid", "unexpected shape"),
    Case("ids_mask_shape_mismatch", "tensor", _tensor(GOOD_IDS, [[1, 1, 1, 1, 1]]), "invalid", "!= attention_mask"),
    Case("token_id_over_vocab", "tensor", _tensor([[101, 10_000_000, 102]]), "invalid", "outside the vocabulary"),
    Case("negative_token_id", "tensor", _tensor([[101, -7, 102]]), "invalid", "outside the vocabulary"),
    Case("mask_all_zero", "tensor", _tensor(GOOD_IDS, [[0, 0, 0, 0]]), "invalid", "no real token"),
    Case("mask_not_binary", "tensor", _tensor(GOOD_IDS, [[1, 5, 1, 1]]), "invalid", "only 0 and 1"),
    Case("zero_length", "tensor", _tensor(np.zeros((1, 0))), "invalid", "seq_len >= 1"),
    Case("missing_mask", "tensor", lambda: [("input_ids", "INT64", np.asarray(GOOD_IDS, np.int64))],
         "invalid", "missing required input"),
    Case("tensor_batch_over_max_batch_size", "tensor", _tensor(np.repeat(GOOD_IDS, 100, axis=0)), "invalid",
         "batch-size must be <="),
    Case("good_tensor", "tensor", _tensor(GOOD_IDS), "ok"),
]
UNKNOWN_CASES = [Case("unknown_model", "unknown", _text("hello"), "not_found", "unknown model")]
ALL_CASES = TEXT_CASES + TENSOR_CASES + UNKNOWN_CASES


def target_model(case: Case, model: str) -> str:
    return {"text": model, "tensor": f"{model}_onnx", "unknown": f"{model}_does_not_exist"}[case.target]


def check(case: Case, protocol: str, outcome) -> str | None:
    """None when the server answered as the case requires, else what was wrong."""
    if case.expect == "ok":
        return None if outcome.ok else f"{case.name}: expected success, got {outcome.status} {outcome.message}"
    want = INVALID[protocol] if case.expect == "invalid" else NOT_FOUND[protocol]
    if outcome.ok:
        return f"{case.name}: expected {want}, got a result"
    if outcome.status != want or case.message.lower() not in outcome.message.lower():
        return f"{case.name}: expected {want} '{case.message}', got {outcome.status} '{outcome.message}'"
    return None


def run_catalogue(urls: dict[str, str], model: str, cases=ALL_CASES) -> list[dict]:
    """Every case over every protocol in `urls` ({"grpc": url, "http": url}); one row per (case, protocol)."""
    rows = []
    for protocol, url in urls.items():
        client = raw_client(protocol, url)
        for case in cases:
            out = raw_infer(client, protocol, target_model(case, model), case.build(), case.parameters)
            rows.append({"case": case.name, "target": case.target, "protocol": protocol, "ok": out.ok,
                         "status": out.status, "message": out.message[:160], "seconds": round(out.seconds, 4),
                         "problem": check(case, protocol, out)})
        client.close()
    return rows


def flood(grpc_url: str, model: str, pid: int, requests: int, workers: int = 4,
          cases=None) -> dict:
    """Send `requests` bad requests (cycling through the error cases), bounded; report RSS before/after."""
    cases = cases or [c for c in ALL_CASES if c.expect != "ok" and c.name != "text_100k_truncate_false"]
    clients = [raw_client("grpc", grpc_url) for _ in range(workers)]
    warm = [c for c in cases for _ in range(3)]  # first touches allocate caches: not a leak
    for case in warm:
        raw_infer(clients[0], "grpc", target_model(case, model), case.build(), case.parameters)
    time.sleep(0.5)
    rss_before = tree_rss_mb(pid)
    kinds: Counter = Counter()
    problems: list[str] = []

    def send(i: int) -> None:
        case = cases[i % len(cases)]
        out = raw_infer(clients[i % workers], "grpc", target_model(case, model), case.build(), case.parameters)
        kinds[out.status or "ok"] += 1
        bad = check(case, "grpc", out)
        if bad and len(problems) < 5:
            problems.append(bad)

    start = time.monotonic()
    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(send, range(requests)))
    seconds = time.monotonic() - start
    time.sleep(0.5)
    rss_after = tree_rss_mb(pid)
    for c in clients:
        c.close()
    return {"requests": requests, "answered": sum(kinds.values()), "lost": requests - sum(kinds.values()),
            "statuses": dict(kinds), "problems": problems, "seconds": seconds,
            "rss_before_mb": rss_before, "rss_after_mb": rss_after, "rss_growth_mb": rss_after - rss_before}

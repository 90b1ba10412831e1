"""`bge-triton chaos`'s bad input: a catalogue of malformed and unusual requests sent through the SDK's own transport
(the kit's request bytes, below the client's input checks), each with the answer it must get, and a flood of them that
watches the server's memory."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from tritonclient.utils import InferenceServerException

from bge_triton.client.core import InferCall
from bge_triton.client.transport import GrpcSync, HttpSync
from bge_triton.errors import kind_of
from bge_triton.loadtest import loadgen
from bge_triton.loadtest.stats import tree_rss_mb

Inputs = list[tuple[str, str, np.ndarray]]  # (name, datatype, array) per input


class RawOutcome(NamedTuple):
    ok: bool
    status: str = ""
    message: str = ""
    rows: int = 0


def raw_client(protocol: str, url: str) -> GrpcSync | HttpSync:
    """The SDK's own transport (client.transport: the kit's request bytes), without the client's input checks."""
    return GrpcSync(url) if protocol == "grpc" else HttpSync(url)


def raw_infer(client: GrpcSync | HttpSync, model: str, inputs: Inputs, parameters: dict | None = None) -> RawOutcome:
    """Send named inputs; never raises for a server answer."""
    call = InferCall(model, tuple(inputs), dict(parameters or {}), rows=len(inputs[0][2]) if inputs else 0)
    try:
        emb = client.infer(call, 30.0).as_numpy("embedding")
        return RawOutcome(True, rows=0 if emb is None else int(emb.shape[0]))
    except InferenceServerException as exc:
        return RawOutcome(False, str(exc.status() or ""), exc.message() or str(exc))


def text_array(texts: Sequence[str | bytes]) -> np.ndarray:
    """BYTES [n, 1]; str items are UTF-8 encoded, bytes items go as they are (invalid UTF-8 too)."""
    items = [t if isinstance(t, bytes) else t.encode("utf-8", "surrogatepass") for t in texts]
    return np.array(items, dtype=np.object_).reshape(-1, 1)


class Case(NamedTuple):
    """A bad (or unusual) input and the answer it must get: "ok", or a kind and a message substring (any case)."""

    name: str
    target: str  # "text" (NAME), "tensor" (NAME_onnx) or "unknown" (a model that does not exist)
    payload: Any  # text: the texts; tensor: (ids, mask[, Triton datatype, default INT64])
    expect: str
    message: str = ""
    parameters: dict | None = None

    def inputs(self) -> Inputs:
        if self.target != "tensor":
            return [("text", "BYTES", text_array(self.payload))]
        ids, mask, dtype = (*self.payload, "INT64")[:3]  # mask None: all ones; False: no mask input at all
        a = np.asarray(ids, dtype={"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}[dtype])
        named = [("input_ids", a), ("attention_mask", np.ones_like(a) if mask is None else np.asarray(mask, a.dtype))]
        return [(name, dtype, arr) for name, arr in named[:1 if mask is False else 2]]


GOOD = [[101, 7592, 2088, 102]]
LONG = "向量检索" * 25_000
CASES: list[tuple[Any, ...]] = [  # the Case fields, in order
    ("empty", "text", [""], "InputError", "empty or whitespace"),
    ("whitespace", "text", [" \t\n\u3000 "], "InputError", "empty or whitespace"),
    ("nul_byte", "text", ["abc\x00def"], "InputError", "NUL byte"),
    ("invalid_utf8", "text", [b"\xff\xfe\xfdabc"], "InputError", "not valid UTF-8"),
    ("lone_surrogate", "text", ["x\ud800y"], "InputError", "not valid UTF-8"),
    ("text_100k_truncated", "text", [LONG], "ok"),
    ("text_100k_truncate_false", "text", [LONG], "InputError", "over the limit", {"truncate": False}),
    ("cjk_extension_b", "text", ["𠀀𠀁𠀂𪚥𠮷野家"], "ok"),
    ("emoji", "text", ["😀🚀👍🏽 家族👨‍👩‍👧"], "ok"),
    ("good_and_bad_in_one_request", "text", ["今天天气很好", "", "ok"], "InputError", "text 1 is empty"),
    ("text_batch_over_max_batch_size", "text", ["短文本"] * 200, "InputError", "batch-size must be <="),
    ("int32_ids", "tensor", (GOOD, None, "INT32"), "InputError", "data-type"),
    ("fp32_ids", "tensor", (GOOD, None, "FP32"), "InputError", "data-type"),
    ("rank3_shape", "tensor", (np.ones((1, 1, 4)), None), "InputError", "unexpected shape"),
    ("ids_mask_shape_mismatch", "tensor", (GOOD, [[1, 1, 1, 1, 1]]), "InputError", "!= attention_mask"),
    ("token_id_over_vocab", "tensor", ([[101, 10_000_000, 102]], None), "InputError", "outside the vocabulary"),
    ("negative_token_id", "tensor", ([[101, -7, 102]], None), "InputError", "outside the vocabulary"),
    ("mask_all_zero", "tensor", (GOOD, [[0, 0, 0, 0]]), "InputError", "no real token"),
    ("mask_not_binary", "tensor", (GOOD, [[1, 5, 1, 1]]), "InputError", "only 0 and 1"),
    ("zero_length", "tensor", (np.zeros((1, 0)), None), "InputError", "seq_len >= 1"),
    ("missing_mask", "tensor", (GOOD, False), "InputError", "missing required input"),
    ("tensor_batch_over_max_batch_size", "tensor", (GOOD * 100, None), "InputError", "batch-size must be <="),
    ("good_tensor", "tensor", (GOOD, None), "ok"),
    ("unknown_model", "unknown", ["hello"], "ModelConfigError", "unknown model"),
]
ALL_CASES = [Case(*c) for c in CASES]


def send_case(client: GrpcSync | HttpSync, case: Case, model: str) -> tuple[RawOutcome, str | None]:
    """Send one case to its model: the outcome, and what was wrong with it (None when it is as the case requires)."""
    target = {"text": model, "tensor": f"{model}_onnx", "unknown": f"{model}_does_not_exist"}[case.target]
    out = raw_infer(client, target, case.inputs(), case.parameters)
    got = "ok" if out.ok else kind_of(out.status)
    if got != case.expect or case.message.lower() not in out.message.lower():
        return out, f"{case.name}: expected {case.expect} '{case.message}', got {got} ({out.status}) '{out.message}'"
    return out, None


def run_catalogue(urls: dict[str, str], model: str) -> list[dict]:
    """Every case over every protocol in `urls` ({"grpc": url, "http": url}); one row per (case, protocol)."""
    rows = []
    for protocol, url in urls.items():
        client = raw_client(protocol, url)
        for case in ALL_CASES:
            out, problem = send_case(client, case, model)
            rows.append({"case": case.name, "protocol": protocol, "ok": out.ok, "status": out.status,
                         "message": out.message[:160], "problem": problem})
        client.close()
    return rows


def flood(grpc_url: str, model: str, pid: int, requests: int, workers: int = 4) -> dict:
    """`requests` bad requests (cycling through the error cases) from `workers` closed-loop users; the server's RSS
    before and after."""
    cases = [c for c in ALL_CASES if c.expect != "ok" and c.name != "text_100k_truncate_false"]
    client = raw_client("grpc", grpc_url)  # thread-safe: one for all the users
    for case in cases * 3:  # first touches allocate caches: not a leak
        send_case(client, case, model)
    time.sleep(0.5)
    rss_before, kinds, problems, sent = tree_rss_mb(pid), Counter[str](), list[str](), [0]

    async def send(_k: int) -> None:
        case = cases[sent[0] % len(cases)]
        sent[0] += 1
        out, bad = await asyncio.to_thread(send_case, client, case, model)
        kinds[kind_of(out.status)] += 1
        if bad and len(problems) < 5:
            problems.append(bad)

    asyncio.run(loadgen.closed_loop(send, workers, lambda: sent[0] >= requests))
    time.sleep(0.5)
    rss_after = tree_rss_mb(pid)
    client.close()
    return {"requests": sent[0], "lost": sent[0] - sum(kinds.values()), "statuses": dict(kinds), "problems": problems,
            "rss_before_mb": rss_before, "rss_after_mb": rss_after, "rss_growth_mb": rss_after - rss_before}

"""`bge-triton chaos [--quick] [--out reports/chaos]`: bad input, overload and faults against real local
tritonservers it starts itself (ports 18200-18299), then chaos.md + chaos.csv + chaos_overload.png: bad inputs tried,
requests sent and lost (must be 0), errors by kind (errors.kind_of), max recovery time, RSS growth. The overload run's
encoder is the costmodel executor (emulated); overload and faults are in chaos_faults.

Each bad-input case (text endpoint NAME, encoder NAME_onnx) says what the server must answer: "ok" or the
errors.kind_of of its status and a substring of the message. Requests go through the SDK's transport below the kit
client (which would refuse to build most of them), so the server's own checks are what is tested.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tritonclient.utils import InferenceServerException

from bge_triton.client.core import InferCall
from bge_triton.client.transport import GrpcSync, HttpSync
from bge_triton.errors import KitError, kind_of
from bge_triton.extras import require
from bge_triton.loadtest import chaos_faults as faults
from bge_triton.loadtest import harness, loadgen, report
from bge_triton.loadtest.stats import tree_rss_mb

require("loadtest", "bge-triton chaos")

COMMAND = "bge-triton chaos"
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
    clients = [raw_client("grpc", grpc_url) for _ in range(workers)]
    for case in cases * 3:  # first touches allocate caches: not a leak
        send_case(clients[0], case, model)
    time.sleep(0.5)
    rss_before, kinds, problems, sent = tree_rss_mb(pid), Counter[str](), list[str](), [0]

    async def send(k: int) -> None:
        case = cases[sent[0] % len(cases)]
        sent[0] += 1
        out, bad = await asyncio.to_thread(send_case, clients[k], case, model)
        kinds[kind_of(out.status)] += 1
        if bad and len(problems) < 5:
            problems.append(bad)

    asyncio.run(loadgen.closed_loop(send, workers, lambda: sent[0] >= requests))
    time.sleep(0.5)
    rss_after = tree_rss_mb(pid)
    for c in clients:
        c.close()
    return {"requests": sent[0], "lost": sent[0] - sum(kinds.values()), "statuses": dict(kinds), "problems": problems,
            "rss_before_mb": rss_before, "rss_after_mb": rss_after, "rss_growth_mb": rss_after - rss_before}


def run(a: argparse.Namespace, repo: Path, work: Path) -> dict:
    """Every scenario in turn; returns all figures."""
    res: dict = {}
    t = time.monotonic()
    print("[1/5] bad-input catalogue + flood", flush=True)
    srv = harness.start_server(repo, work / "inputs", port_range=faults.PORT_RANGE)
    try:
        res["catalogue"] = run_catalogue({"grpc": srv.grpc_url, "http": srv.http_url}, a.model)
        res["flood"] = flood(srv.grpc_url, a.model, srv.pid, a.flood or (1500 if a.quick else 10_000))
    finally:
        srv.stop()
    print("[2/5] overload at 3x capacity", flush=True)
    over_s = a.overload_s or (8.0 if a.quick else 60.0)
    res["overload"] = faults.run_overload(repo, work / "overload", a.model, overload_s=over_s)
    print("[3/5] kill -9 of tritonserver under load (gRPC, HTTP)", flush=True)
    res["kill9"] = [faults.kill9_under_load(repo, work / f"kill9_{p}", a.model, protocol=p) for p in ("grpc", "http")]
    print("[4/5] kill -9 of a python backend stub", flush=True)
    res["stub"] = faults.kill_stub(repo, work / "stub", a.model, watch_s=5.0 if a.quick else 30.0)
    print("[5/5] broken model files at start", flush=True)
    res["broken"] = [faults.broken_start(repo, work, c, a.model) for c in list(faults.BREAKAGES)[:4 if a.quick else 6]]
    res["seconds"] = time.monotonic() - t
    return res


def summary(res: dict) -> dict:
    """The headline figures."""
    cat, fl, ov, k9s = res["catalogue"], res["flood"], res["overload"], res["kill9"]
    kinds = Counter("ok" if r["ok"] else kind_of(r["status"]) for r in cat) + Counter(fl["statuses"])
    for section, x in [("overload", ov), *(("kill9", k) for k in k9s)]:
        kinds += Counter({f"{section}:{k}": v for k, v in x["outcomes"].items()})
    recov = [k["max_recovery_s"] for k in k9s if k["max_recovery_s"] is not None] + [ov["recovery_s"]]
    return {
        "bad_input_cases": len({r["case"] for r in cat}), "catalogue_requests": len(cat),
        "catalogue_problems": sum(1 for r in cat if r["problem"]),
        "requests_sent": len(cat) + fl["requests"] + ov["requests"] + ov["retry_requests"]
        + sum(k["requests"] for k in k9s),
        "requests_lost": fl["lost"] + ov["lost"],  # every other request is counted from its own outcome
        "errors_by_kind": dict(kinds), "max_recovery_s": max(recov), "rss_growth_mb_flood": fl["rss_growth_mb"],
        "flood_requests": fl["requests"], "rss_growth_mb_overload": ov["rss_growth_mb"],
        "broken_start_clear": sum(1 for b in res["broken"] if b["rc"] != 0), "broken_start_cases": len(res["broken"]),
    }


def _figure(ov: dict, path: Path, command: str) -> None:
    fig, (ax,) = report.subplots(1, 9, 4)
    for outcome, colour in (("ok", "tab:blue"), ("Overloaded", "tab:red")):
        pts = [(s.sched, s.latency * 1000) for s in ov["shots"] if s.outcome == outcome]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=4, c=colour, label=outcome)
    ax.axhline(ov["latency_bound_s"] * 1000, ls="--", c="grey", label="queue-policy bound")
    ax.set(xlabel="scheduled send time (s); overload between the baseline and recovery phases", ylabel="latency (ms)",
           title=f"3x overload (emulated encoder): capacity {ov['capacity_rps']:.0f} rps, offered "
           f"{ov['offered_rps']:.0f} rps")
    ax.legend(loc="upper right")
    report.save_figure(fig, path, command)


def _csv(res: dict, s: dict, out: Path, command: str) -> None:
    def cell(v: object) -> object:
        return json.dumps(v, ensure_ascii=False)[:400] if isinstance(v, (dict, list, tuple)) else v

    rows: list[tuple[object, ...]] = [("summary", k, "", cell(v), "") for k, v in s.items()]
    rows += [("bad_input", r["case"], r["protocol"], "ok" if r["ok"] else kind_of(r["status"]),
              f"{r['status']} {r['message']}".strip()) for r in res["catalogue"]]
    rows += [("overload", k, "grpc", cell(v), "") for k, v in res["overload"].items() if k != "shots"]
    rows += [("kill9", k, k9["protocol"], cell(v), "") for k9 in res["kill9"] for k, v in k9.items()]
    rows += [("stub_kill", k, "grpc", cell(v), "") for k, v in res["stub"].items()]
    rows += [("broken_start", b["case"], "", b["rc"], cell(b["stderr"].splitlines()[:4])) for b in res["broken"]]
    fields = ("section", "name", "protocol", "value", "detail")
    report.write_csv([dict(zip(fields, r, strict=True)) for r in rows], fields, out / "chaos.csv", command)


def write_report(res: dict, command: str, model: str, machine: str) -> Path:
    out = Path(res["out"])
    s, ov, fl, st = summary(res), res["overload"], res["flood"], res["stub"]
    _csv(res, s, out, command)
    _figure(ov, out / "chaos_overload.png", command)
    by: dict[str, dict[str, dict]] = {}
    for r in res["catalogue"]:
        by.setdefault(r["case"], {})[r["protocol"]] = r
    lines = [
        f"Machine: {machine}; {res['seconds']:.0f} s. Model: `{model}` (real MiniLM weights "
        "for bad input and faults; the overload run uses the costmodel executor, an **emulated** encoder with a "
        "deterministic capacity).", "",
        *report.table("figure | value", [
            ("bad-input cases tried (x gRPC, HTTP)", f"{s['bad_input_cases']} ({s['catalogue_requests']} requests, "
             f"{s['catalogue_problems']} answered wrongly)"),
            ("requests sent (all scenarios)", s["requests_sent"]),
            ("requests lost (no result and no error)", f"**{s['requests_lost']}**"),
            ("max recovery time", f"{s['max_recovery_s']:.2f} s"),
            (f"RSS growth after {fl['requests']} bad requests", f"{fl['rss_growth_mb']:+.1f} MiB "
             f"({fl['rss_before_mb']:.0f} -> {fl['rss_after_mb']:.0f} MiB, tritonserver + stubs)"),
            ("broken model files: `server up` failed with the cause named",
             f"{s['broken_start_clear']}/{s['broken_start_cases']}")]), "",
        "Errors by kind (errors.kind_of of the exception or status): "
        + ", ".join(f"`{k}` {v}" for k, v in sorted(s["errors_by_kind"].items())), "",
        "## Overload (3x capacity)", "",
        f"Capacity measured closed-loop: {ov['capacity_rps']:.1f} rps; offered {ov['offered_rps']:.1f} rps for "
        f"{ov['overload_s']:.0f} s (Poisson, open loop, latency from the scheduled send time). Outcomes in the "
        f"overload phase: {ov['overload_outcomes']}; lost (no answer within the deadline): {ov['lost']}.",
        f"Accepted latency p99 {ov['accepted_p99_s'] * 1000:.0f} ms, max {ov['accepted_max_s'] * 1000:.0f} ms; "
        f"rejections (503/UNAVAILABLE) max {ov['rejected_max_s'] * 1000:.0f} ms; queue-policy bound "
        f"{ov['latency_bound_s'] * 1000:.0f} ms. Back to normal latency {ov['recovery_s']:.2f} s after the load "
        f"dropped. Server up and ready after: {ov['server_alive_after'] and ov['server_ready_after']}.",
        f"Retries (RetryPolicy max_attempts={ov['retry_policy_max_attempts']}, full jitter, client-wide RetryBudget) "
        f"under the same storm: {ov['retry_requests']} requests -> {ov['retry_attempts']} attempts "
        f"({ov['retry_attempts'] / max(1, ov['retry_requests']):.2f} per request, max "
        f"{ov['retry_max_attempts_seen']}); outcomes {ov['retry_outcomes']}. The retry budget stops retrying while "
        "rejections dominate, so retries do not multiply the offered load.",
        "", "![overload](chaos_overload.png)", "",
        "## kill -9 of tritonserver under load", "",
        *report.table("protocol | first error after kill | error kinds | restart | same clients OK after ready | "
                      "stubs gone after kill | /dev/shm regions left",
                      [(k["protocol"], f"{k['max_time_to_error_s']:.3f} s", k["error_kinds_after_kill"],
                        f"{k['restart_s']:.1f} s", report.fmt(k["same_clients_ok_after_restart_s"], 2) + " s",
                        f"{k['stubs_exited_after_kill_s']:.2f} s" if k["stubs_exited_after_kill_s"] is not None
                        else "not within 15 s: " + ", ".join(k["stubs_outliving_server"] or ["?"]) + " (killed)",
                        k["shm_regions_left"]) for k in res["kill9"]]),
        "", "Recovery counts from the restart to every old client succeeding. Triton 2.51's python stubs exit when "
        "they notice their server is gone, but in some runs one does not within 15 s; the harness then kills it "
        "(named in the table) before the restart.",
        "", "## kill -9 of the encoder's python stub", "",
        f"Server alive: {st['server_alive']}; server/model still report ready: {st['server_ready']}/"
        f"{st['encoder_ready']}; first success after the kill: {st['first_ok_after_kill_s']}; a new stub was "
        f"started: {st['new_stub']}. Errors seen ({len(st['errors'])}): "
        f"`{st['errors'][0][2] if st['errors'] else '-'}`. Recovery: restart the server "
        "(`python -m bge_triton.server down && python -m bge_triton.server up ...`).",
        "", "## Broken model files at `server up`", "",
        *(f"- `{b['case']}`: rc {b['rc']} after {b['seconds']:.1f} s: `" + next(
            (ln for ln in b["stderr"].splitlines() if ln.strip().startswith("- ")), b["stderr"][:200]).strip()[:260]
          + "`" for b in res["broken"]),
        "", "## Bad-input catalogue", "",
        *report.table("case | gRPC | HTTP | message",
                      [(case, *("ok" if p.get(x, {}).get("ok") else kind_of(p.get(x, {}).get("status"))
                                for x in ("grpc", "http")), (p["grpc"]["message"] or "").replace("|", "/")[:110])
                       for case, p in by.items()]),
    ]
    return report.write_md(out / "chaos.md", command, "Chaos report: bad input, overload, faults", lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, default=None,
                   help="exported repository with NAME + NAME_onnx (default: export MiniLM into a temp dir)")
    p.add_argument("--model", default="minilm", help="model NAME in the repository (default minilm)")
    p.add_argument("--out", type=Path, default=Path("reports/chaos"))
    p.add_argument("--quick", action="store_true", help="CI-sized: 1500 bad requests, 8 s of overload, 4 breakages")
    p.add_argument("--flood", type=int, default=None, help="bad requests in the RSS flood (default 10000)")
    p.add_argument("--overload-s", type=float, default=None, help="seconds at 3x capacity (default 60)")
    a, load = p.parse_args(argv), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kit-chaos-") as tmp:
        work = Path(tmp)
        repo = a.repository or work / "repo"
        if a.repository is None:
            harness.export("sentence-transformers/all-MiniLM-L6-v2", repo, "minilm", "fp32", "--quiet")
        try:
            res = run(a, repo, work)
        except KitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    res["out"] = a.out
    path = write_report(res, " ".join([COMMAND, *argv]), a.model, report.machine_line(load))
    s = summary(res)
    print(f"wrote {path}: {s['requests_sent']} requests, lost {s['requests_lost']}, max recovery "
          f"{s['max_recovery_s']:.2f} s, RSS growth {s['rss_growth_mb_flood']:+.1f} MiB")
    return 0 if s["requests_lost"] == 0 and s["catalogue_problems"] == 0 else 1

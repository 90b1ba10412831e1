"""`bge-triton chaos [--quick] [--out reports/chaos]`: bad input, overload and faults against real local
tritonservers it starts itself (ports 18200-18299), then chaos.md + chaos.csv + chaos_overload.png.

Figures: bad inputs tried, requests sent, requests lost (must be 0), errors by kind (errors.kind_of), max recovery
time, RSS growth. The encoder of the overload run is the costmodel executor (emulated).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bge_triton.errors import KitError, kind_of
from bge_triton.extras import require
from bge_triton.loadtest import harness, report
from bge_triton.loadtest.chaos_faults import PORT_RANGE, broken_start, kill9_under_load, kill_stub
from bge_triton.loadtest.chaos_inputs import flood, run_catalogue
from bge_triton.loadtest.chaos_overload import OverloadSettings, run_overload

require("loadtest", "bge-triton chaos")

COMMAND = "bge-triton chaos"
BROKEN = ("onnx_missing", "onnx_corrupt", "tokenizer_missing", "config_corrupt", "onnx_truncated", "tokenizer_corrupt")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, default=None,
                   help="exported repository with NAME + NAME_onnx (default: export MiniLM into a temp dir)")
    p.add_argument("--model", default="minilm", help="model NAME in the repository (default minilm)")
    p.add_argument("--out", type=Path, default=Path("reports/chaos"))
    p.add_argument("--quick", action="store_true", help="CI-sized: 1500 bad requests, 8 s of overload, 4 breakages")
    p.add_argument("--flood", type=int, default=None, help="bad requests in the RSS flood (default 10000)")
    p.add_argument("--overload-s", type=float, default=None, help="seconds at 3x capacity (default 60)")
    return p


def run(a: argparse.Namespace, repo: Path, work: Path) -> dict:
    """Every scenario in turn; returns all figures."""
    res: dict = {}
    t = time.monotonic()
    print("[1/5] bad-input catalogue + flood", flush=True)
    srv = harness.start_server(repo, work / "inputs", port_range=PORT_RANGE)
    try:
        res["catalogue"] = run_catalogue({"grpc": srv.grpc_url, "http": srv.http_url}, a.model)
        res["flood"] = flood(srv.grpc_url, a.model, srv.pid, a.flood or (1500 if a.quick else 10_000))
    finally:
        srv.stop()
    print("[2/5] overload at 3x capacity", flush=True)
    res["overload"] = run_overload(OverloadSettings(repo, work / "overload", model=a.model,
                                                    overload_s=a.overload_s or (8.0 if a.quick else 60.0)))
    print("[3/5] kill -9 of tritonserver under load (gRPC, HTTP)", flush=True)
    res["kill9"] = [kill9_under_load(repo, work / f"kill9_{p}", a.model, protocol=p) for p in ("grpc", "http")]
    print("[4/5] kill -9 of a python backend stub", flush=True)
    res["stub"] = kill_stub(repo, work / "stub", a.model, watch_s=5.0 if a.quick else 30.0)
    print("[5/5] broken model files at start", flush=True)
    res["broken"] = [broken_start(repo, work, c, a.model) for c in BROKEN[:4 if a.quick else None]]
    res["seconds"] = time.monotonic() - t
    return res


def summary(res: dict) -> dict:
    """The headline figures."""
    cat, fl, ov = res["catalogue"], res["flood"], res["overload"]
    kinds = Counter("ok" if r["ok"] else kind_of(r["status"]) for r in cat) + Counter(fl["statuses"])
    kinds += Counter({f"overload:{k}": v for k, v in ov["outcomes"].items()})
    for k9 in res["kill9"]:
        kinds += Counter({f"kill9:{k}": v for k, v in k9["outcomes"].items()})
    recov = [k["max_recovery_s"] for k in res["kill9"] if k["max_recovery_s"] is not None] + [ov["recovery_s"]]
    return {
        "bad_input_cases": len({r["case"] for r in cat}), "catalogue_requests": len(cat),
        "catalogue_problems": sum(1 for r in cat if r["problem"]),
        "requests_sent": len(cat) + fl["requests"] + ov["requests"] + ov["retry_requests"]
        + sum(k["requests"] for k in res["kill9"]),
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
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=4, c=colour, label=outcome)
    ax.axhline(ov["latency_bound_s"] * 1000, ls="--", c="grey", label="queue-policy bound")
    ax.set_xlabel("scheduled send time (s); overload between the baseline and recovery phases")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"3x overload (emulated encoder): capacity {ov['capacity_rps']:.0f} rps, offered "
                 f"{ov['offered_rps']:.0f} rps")
    ax.legend(loc="upper right")
    report.save_figure(fig, path, command)


def _cell(v: object) -> object:
    return json.dumps(v, ensure_ascii=False)[:400] if isinstance(v, (dict, list, tuple)) else v


def write_report(res: dict, command: str, model: str, machine: str) -> Path:
    out = Path(res["out"])
    out.mkdir(parents=True, exist_ok=True)
    s, ov, fl, st = summary(res), res["overload"], res["flood"], res["stub"]
    rows: list[tuple[object, ...]] = [("summary", k, "", _cell(v), "") for k, v in s.items()]
    rows += [("bad_input", r["case"], r["protocol"], "ok" if r["ok"] else kind_of(r["status"]),
              f"{r['status']} {r['message']}".strip()) for r in res["catalogue"]]
    rows += [("overload", k, "grpc", _cell(v), "") for k, v in ov.items() if k != "shots"]
    rows += [("kill9", k, k9["protocol"], _cell(v), "") for k9 in res["kill9"] for k, v in k9.items()]
    rows += [("stub_kill", k, "grpc", _cell(v), "") for k, v in st.items()]
    rows += [("broken_start", b["case"], "", b["rc"], _cell(b["stderr"].splitlines()[:4])) for b in res["broken"]]
    fields = ("section", "name", "protocol", "value", "detail")
    report.write_csv([dict(zip(fields, r, strict=True)) for r in rows], fields, out / "chaos.csv", command)
    _figure(ov, out / "chaos_overload.png", command)
    gone = {k["protocol"]: f"{k['stubs_exited_after_kill_s']:.2f} s" if k["stubs_exited_after_kill_s"] is not None
            else "not within 15 s: " + ", ".join(k["stubs_outliving_server"] or ["?"]) + " (killed)"
            for k in res["kill9"]}
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
                        gone[k["protocol"]], k["shm_regions_left"]) for k in res["kill9"]]),
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
    a = _parser().parse_args(argv)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kit-chaos-") as tmp:
        work = Path(tmp)
        repo = a.repository
        if repo is None:
            repo = work / "repo"
            subprocess.run([sys.executable, "-m", "bge_triton.export", "--model",
                            "sentence-transformers/all-MiniLM-L6-v2", "--repository", str(repo), "--name", "minilm",
                            "--precision", "fp32", "--quiet"], check=True)
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

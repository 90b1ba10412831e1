"""`bge-triton chaos [--quick] [--out reports/chaos]`: bad input, overload and faults against
real local tritonservers it starts itself (ports 18200-18299), then chaos.md + chaos.csv + PNG.

Figures: bad inputs tried, requests sent, requests lost (must be 0), errors by kind, max
recovery time, RSS growth. The encoder of the overload run is the costmodel executor (emulated).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bge_triton.errors import KitError
from bge_triton.extras import require
from bge_triton.loadtest import report
from bge_triton.loadtest.chaos_common import start_server
from bge_triton.loadtest.chaos_faults import broken_start, kill9_under_load, kill_stub
from bge_triton.loadtest.chaos_inputs import flood, run_catalogue
from bge_triton.loadtest.chaos_overload import OverloadSettings, run_overload

require("loadtest", "bge-triton chaos")

COMMAND = "bge-triton chaos"


@dataclass(frozen=True)
class ChaosSettings:
    """Built once from flags."""

    repository: Path
    out: Path
    model: str
    quick: bool
    flood: int
    overload_s: float


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, default=None,
                   help="exported repository with NAME + NAME_onnx (default: export MiniLM into a temp dir)")
    p.add_argument("--model", default="minilm", help="model NAME in the repository (default minilm)")
    p.add_argument("--out", type=Path, default=Path("reports/chaos"))
    p.add_argument("--quick", action="store_true", help="CI-sized: 1500 bad requests, 8 s of overload")
    p.add_argument("--flood", type=int, default=None, help="bad requests in the RSS flood (default 10000)")
    p.add_argument("--overload-s", type=float, default=None, help="seconds at 3x capacity (default 60)")
    return p


def _export_minilm(work: Path) -> Path:
    repo = work / "repo"
    cmd = [sys.executable, "-m", "bge_triton.export", "--model", "sentence-transformers/all-MiniLM-L6-v2",
           "--repository",
           str(repo), "--name", "minilm", "--precision", "fp32", "--quiet"]
    subprocess.run(cmd, check=True)
    return repo


def run(settings: ChaosSettings, work: Path) -> dict:
    """Every scenario in turn; returns all figures."""
    res: dict = {}
    t = time.monotonic()
    print("[1/5] bad-input catalogue + flood", flush=True)
    srv = start_server(settings.repository, work / "inputs")
    try:
        res["catalogue"] = run_catalogue({"grpc": srv.grpc_url, "http": srv.http_url}, settings.model)
        res["flood"] = flood(srv.grpc_url, settings.model, srv.pid, settings.flood)
    finally:
        srv.stop()
    print("[2/5] overload at 3x capacity", flush=True)
    ov = run_overload(OverloadSettings(settings.repository, work / "overload", model=settings.model,
                                       overload_s=settings.overload_s))
    res["overload_shots"] = ov.pop("shots")
    res["overload"] = ov
    print("[3/5] kill -9 of tritonserver under load (gRPC, HTTP)", flush=True)
    res["kill9"] = [kill9_under_load(settings.repository, work / f"kill9_{p}", settings.model, protocol=p)
                    for p in ("grpc", "http")]
    print("[4/5] kill -9 of a python backend stub", flush=True)
    res["stub"] = kill_stub(settings.repository, work / "stub", settings.model, watch_s=5.0 if settings.quick else 30.0)
    print("[5/5] broken model files at start", flush=True)
    cases = ["onnx_missing", "onnx_corrupt", "tokenizer_missing", "config_corrupt"]
    if not settings.quick:
        cases += ["onnx_truncated", "tokenizer_corrupt"]
    res["broken"] = [broken_start(settings.repository, work, c, settings.model) for c in cases]
    res["seconds"] = time.monotonic() - t
    return res


def summary(res: dict) -> dict:
    """The headline figures."""
    cat, fl, ov = res["catalogue"], res["flood"], res["overload"]
    kinds: Counter = Counter()
    for row in cat:
        kinds["ok" if row["ok"] else row["status"]] += 1
    for k, v in fl["statuses"].items():
        kinds[k] += v
    for k, v in ov["outcomes"].items():
        kinds[f"overload:{k}"] += v
    for k, v in Counter(o for k9 in res["kill9"] for o, n in k9["outcomes"].items() for _ in range(n)).items():
        kinds[f"kill9:{k}"] += v
    sent = len(cat) + fl["requests"] + ov["requests"] + ov["retry_requests"] + sum(k["requests"] for k in res["kill9"])
    lost = fl["lost"] + ov["hung"]  # every other request is counted from its own outcome
    recov = [k["max_recovery_s"] for k in res["kill9"] if k["max_recovery_s"] is not None] + [ov["recovery_s"]]
    return {
        "bad_input_cases": len({r["case"] for r in cat}), "catalogue_requests": len(cat),
        "catalogue_problems": sum(1 for r in cat if r["problem"]),
        "requests_sent": sent, "requests_lost": lost, "errors_by_kind": dict(kinds),
        "max_recovery_s": max(recov), "rss_growth_mb_flood": fl["rss_growth_mb"],
        "flood_requests": fl["requests"], "rss_growth_mb_overload": ov["rss_growth_mb"],
        "broken_start_clear": sum(1 for b in res["broken"] if b["rc"] != 0),
        "broken_start_cases": len(res["broken"]),
    }


def _figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shots = res["overload_shots"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for outcome, colour in (("ok", "tab:blue"), ("overloaded", "tab:red")):
        pts = [(s.sched, s.latency * 1000) for s in shots if s.outcome == outcome]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, s=4, c=colour, label=outcome)
    ov = res["overload"]
    ax.axhline(ov["latency_bound_s"] * 1000, ls="--", c="grey", label="queue-policy bound")
    ax.set_xlabel("scheduled send time (s); overload between the baseline and recovery phases")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"3x overload (emulated encoder): capacity {ov['capacity_rps']:.0f} rps, offered "
                 f"{ov['offered_rps']:.0f} rps")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gone(k: dict) -> str:
    """When the killed server's stubs were gone, or which outlived it (killed by the harness)."""
    if k.get("stubs_exited_after_kill_s") is not None:
        return f"{k['stubs_exited_after_kill_s']:.2f} s"
    return "not within 15 s: " + ", ".join(k.get("stubs_outliving_server") or ["?"]) + " (killed)"


def write_report(res: dict, settings: ChaosSettings, argv: list[str]) -> Path:
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    s = summary(res)
    machine = report.machine_line()
    cmd = " ".join([COMMAND, *argv])
    def row(section: str, name: str, protocol: str, value: object, detail: object = "") -> dict[str, object]:
        return {"section": section, "name": name, "protocol": protocol, "value": value, "detail": detail}

    rows = [row("summary", k, "", json.dumps(v) if isinstance(v, dict) else v) for k, v in s.items()]
    rows += [row("bad_input", r["case"], r["protocol"], "ok" if r["ok"] else r["status"], r["message"])
             for r in res["catalogue"]]
    rows += [row("overload", k, "grpc", json.dumps(v) if isinstance(v, dict) else v)
             for k, v in res["overload"].items()]
    rows += [row("kill9", k, k9["protocol"], json.dumps(v) if isinstance(v, (dict, list)) else v)
             for k9 in res["kill9"] for k, v in k9.items()]
    rows += [row("stub_kill", k, "grpc", json.dumps(v, ensure_ascii=False)[:400]) for k, v in res["stub"].items()]
    rows += [row("broken_start", b["case"], "", b["rc"], b["stderr"].splitlines()[0:4]) for b in res["broken"]]
    report.write_csv(rows, ("section", "name", "protocol", "value", "detail"), out / "chaos.csv", cmd)
    _figure(res, out / "chaos_overload.png")
    ov, fl, st = res["overload"], res["flood"], res["stub"]
    lines = [
        f"<!-- Generated by `{cmd}`; rerun that command to regenerate. -->",
        "# Chaos report: bad input, overload, faults",
        "",
        f"Machine: {machine}. Command: `{cmd}` ({res['seconds']:.0f} s). Model: `{settings.model}` "
        "(real MiniLM weights for bad input and faults; the overload run uses the costmodel executor, an "
        "**emulated** encoder with a deterministic capacity).",
        "",
        "| figure | value |", "|---|---|",
        f"| bad-input cases tried (x gRPC, HTTP) | {s['bad_input_cases']} ({s['catalogue_requests']} requests, "
        f"{s['catalogue_problems']} answered wrongly) |",
        f"| requests sent (all scenarios) | {s['requests_sent']} |",
        f"| requests lost (no result and no error) | **{s['requests_lost']}** |",
        f"| max recovery time | {s['max_recovery_s']:.2f} s |",
        f"| RSS growth after {fl['requests']} bad requests | {fl['rss_growth_mb']:+.1f} MiB "
        f"({fl['rss_before_mb']:.0f} -> {fl['rss_after_mb']:.0f} MiB, tritonserver + stubs) |",
        f"| broken model files: `server up` failed with the cause named | {s['broken_start_clear']}/"
        f"{s['broken_start_cases']} |",
        "",
        "Errors by kind: " + ", ".join(f"`{k}` {v}" for k, v in sorted(s["errors_by_kind"].items())),
        "",
        "## Overload (3x capacity)", "",
        f"Capacity measured closed-loop: {ov['capacity_rps']:.1f} rps; offered {ov['offered_rps']:.1f} rps "
        f"for {ov['overload_s']:.0f} s (Poisson, open loop, latency from the scheduled send time). "
        f"Outcomes in the overload phase: {ov['overload_outcomes']}; hung past the deadline: {ov['hung']}.",
        f"Accepted latency p99 {ov['accepted_p99_s'] * 1000:.0f} ms, max {ov['accepted_max_s'] * 1000:.0f} ms; "
        f"rejections (503/UNAVAILABLE) max {ov['rejected_max_s'] * 1000:.0f} ms; queue-policy bound "
        f"{ov['latency_bound_s'] * 1000:.0f} ms. Back to normal latency {ov['recovery_s']:.2f} s after the "
        f"load dropped. Server up and ready after: {ov['server_alive_after'] and ov['server_ready_after']}.",
        f"Retries (RetryPolicy max_attempts={ov['retry_policy_max_attempts']}, full jitter, client-wide "
        "RetryBudget) under the same "
        f"storm: {ov['retry_requests']} requests -> {ov['retry_attempts']} attempts "
        f"({ov['retry_attempts'] / max(1, ov['retry_requests']):.2f} per request, max "
        f"{ov['retry_max_attempts_seen']}); outcomes {ov['retry_outcomes']}. The retry budget stops "
        "retrying while rejections dominate, so retries do not multiply the offered load.",
        "", "![overload](chaos_overload.png)", "",
        "## kill -9 of tritonserver under load", "",
        "| protocol | first error after kill | error kinds | restart | same clients OK after ready | "
        "stubs gone after kill | /dev/shm regions left |", "|---|---|---|---|---|---|---|",
    ]
    for k in res["kill9"]:
        lines.append(f"| {k['protocol']} | {k['max_time_to_error_s']:.3f} s | {k['error_kinds_after_kill']} | "
                     f"{k['restart_s']:.1f} s | {k['same_clients_ok_after_restart_s']} s | "
                     f"{_gone(k)} | {k['shm_regions_left']} |")
    lines += ["", "Recovery counts from the restart to every old client succeeding. Triton 2.51's python stubs "
              "exit when they notice their server is gone, but in some runs one does not within 15 s; the "
              "harness then kills it (named in the table) before the restart.",
              "", "## kill -9 of the encoder's python stub", "",
              f"Server alive: {st['server_alive']}; server/model still report ready: {st['server_ready']}/"
              f"{st['encoder_ready']}; first success after the kill: {st['first_ok_after_kill_s']}; "
              f"a new stub was started: {st['new_stub']}. Errors seen ({len(st['errors'])}): "
              f"`{st['errors'][0][2] if st['errors'] else '-'}`. Recovery: restart the server "
              "(`python -m bge_triton.server down && python -m bge_triton.server up ...`).",
              "", "## Broken model files at `server up`", ""]
    for b in res["broken"]:
        first = next((ln for ln in b["stderr"].splitlines() if ln.strip().startswith("- ")), b["stderr"][:200])
        lines.append(f"- `{b['case']}`: rc {b['rc']} after {b['seconds']:.1f} s: `{first.strip()[:260]}`")
    lines += ["", "## Bad-input catalogue", "", "| case | gRPC | HTTP | message |", "|---|---|---|---|"]
    by: dict[str, dict[str, dict]] = {}
    for r in res["catalogue"]:
        by.setdefault(r["case"], {})[r["protocol"]] = r
    for case, per_protocol in by.items():
        g, h = per_protocol.get("grpc", {}), per_protocol.get("http", {})
        lines.append(f"| {case} | {'ok' if g.get('ok') else g.get('status')} | "
                     f"{'ok' if h.get('ok') else h.get('status')} "
                     f"| {(g.get('message') or '').replace('|', '/')[:110]} |")
    (out / "chaos.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out / "chaos.md"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    flood_n = args.flood or (1500 if args.quick else 10_000)
    overload_s = args.overload_s or (8.0 if args.quick else 60.0)
    with tempfile.TemporaryDirectory(prefix="kit-chaos-") as tmp:
        work = Path(tmp)
        repo = args.repository or _export_minilm(work)
        settings = ChaosSettings(repo, args.out, args.model, args.quick, flood_n, overload_s)
        try:
            res = run(settings, work)
        except KitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        path = write_report(res, settings, argv)
    s = summary(res)
    print(f"wrote {path}: {s['requests_sent']} requests, lost {s['requests_lost']}, max recovery "
          f"{s['max_recovery_s']:.2f} s, RSS growth {s['rss_growth_mb_flood']:+.1f} MiB")
    return 0 if s["requests_lost"] == 0 and s["catalogue_problems"] == 0 else 1

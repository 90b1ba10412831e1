"""`bge-triton chaos`'s report: the summary of every scenario's record, chaos.md, chaos.csv and chaos_overload.png."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from bge_triton.errors import kind_of
from bge_triton.loadtest import report


def summary(res: dict) -> dict:
    cat, fl, ov, k9s = res["catalogue"], res["flood"], res["overload"], res["kill9"]
    kinds = Counter("ok" if r["ok"] else kind_of(r["status"]) for r in cat) + Counter(fl["statuses"])
    for section, x in [("overload", ov), *(("kill9", k) for k in k9s)]:
        kinds += Counter({f"{section}:{k}": v for k, v in x["outcomes"].items()})
    recov = [x for x in [*(k["max_recovery_s"] for k in k9s), ov["recovery_s"]] if x is not None]
    outcomes = [ov["spike"], *(k["outcome"] for k in k9s), res["stub"]["outcome"]]
    return {
        "bad_input_cases": len({r["case"] for r in cat}), "catalogue_requests": len(cat),
        "catalogue_problems": sum(1 for r in cat if r["problem"]),
        "requests_sent": len(cat) + fl["requests"] + ov["requests"] + ov["retry_requests"]
        + sum(k["requests"] for k in k9s),
        "requests_lost": fl["lost"] + ov["lost"] + ov["retry_requests"] - ov["retry_answered"]  # sent, not answered
        + sum(k["requests"] - k["answered"] for k in k9s),
        "faults_recovered": sum(o["recovered"] for o in outcomes), "faults": len(outcomes),
        "errors_by_kind": dict(kinds), "max_recovery_s": max(recov, default=None),
        "rss_growth_mb_flood": fl["rss_growth_mb"],
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


def write_report(res: dict, command: str, model: str, machine: dict | None = None) -> Path:
    out = Path(res["out"])
    s, ov, fl, st = summary(res), res["overload"], res["flood"], res["stub"]
    _csv(res, s, out, command)
    _figure(ov, out / "chaos_overload.png", command)
    by: dict[str, dict[str, dict]] = {}
    for r in res["catalogue"]:
        by.setdefault(r["case"], {})[r["protocol"]] = r
    lines = [
        *report.header(machine),
        f"{res['seconds']:.0f} s. Model: `{model}` (real MiniLM weights "
        "for bad input and faults; the overload run uses the costmodel executor, an **emulated** encoder with a "
        "deterministic capacity).", "",
        *report.table("figure | value", [
            ("bad-input cases tried (x gRPC, HTTP)", f"{s['bad_input_cases']} ({s['catalogue_requests']} requests, "
             f"{s['catalogue_problems']} answered wrongly)"),
            ("requests sent (all scenarios)", s["requests_sent"]),
            ("requests lost (no result and no error)", f"**{s['requests_lost']}**"),
            ("faults recovered: ready again on the same address, a success, p99 back to normal (the dead stub is "
             "not: nothing restarts it here)", f"{s['faults_recovered']}/{s['faults']}"),
            ("max recovery time", f"{report.fmt(s['max_recovery_s'], 2)} s"),
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
        f"{ov['latency_bound_s'] * 1000:.0f} ms. Back to normal latency (faults.judge) "
        f"{report.fmt(ov['recovery_s'], 2)} s after the load dropped. Server up and ready after: "
        f"{ov['server_alive_after'] and ov['server_ready_after']}.",
        f"Retries (RetryPolicy max_attempts={ov['retry_policy_max_attempts']}, full jitter, client-wide RetryBudget) "
        f"under the same storm: {ov['retry_requests']} requests -> {ov['retry_attempts']} attempts "
        f"({ov['retry_attempts'] / max(1, ov['retry_requests']):.2f} per request, max "
        f"{ov['retry_max_attempts_seen']}); outcomes {ov['retry_outcomes']}. The retry budget stops retrying while "
        "rejections dominate, so retries do not multiply the offered load.",
        "", "![overload](chaos_overload.png)", "",
        "## kill -9 of tritonserver under load", "",
        *report.table("protocol | first error after kill | error kinds | restart | same clients OK after ready | "
                      "recovered | stubs gone after kill | /dev/shm regions left",
                      [(k["protocol"], report.fmt(k["max_time_to_error_s"], 3) + " s", k["error_kinds_after_kill"],
                        f"{k['restart']}, {report.fmt(k['restart_s'], 1)} s",
                        report.fmt(k["same_clients_ok_after_restart_s"], 2) + " s",
                        "yes" if k["recovered"] else "**no**",
                        f"{k['stubs_exited_after_kill_s']:.2f} s" if k["stubs_exited_after_kill_s"] is not None
                        else "not within 15 s: " + ", ".join(k["stubs_outliving_server"] or ["?"]) + " (killed)",
                        k["shm_regions_left"]) for k in res["kill9"]]),
        "", "Recovery counts from the restart to every old client succeeding; 'recovered' is faults.judge's (ready "
        "again on the same ports, a success, p99 back to normal). While the server is down its ports are held, and "
        "it is restarted on them or the restart column names who took them. Triton 2.51's python stubs exit when "
        "they notice their server is gone, but in some runs one does not within 15 s; the harness then kills it "
        "(named in the table) before the restart.",
        "", "## kill -9 of the encoder's python stub", "",
        f"Server alive: {st['server_alive']}; server/model still report ready: {st['server_ready']}/"
        f"{st['encoder_ready']}; first success after the kill: {report.fmt(st['first_ok_after_kill_s'], 2)} s; "
        f"a new stub was started: {st['new_stub']}. Errors seen ({len(st['errors'])}): "
        f"`{st['errors'][0][2] if st['errors'] else '-'}`. Recovery: restart the server "
        "(`bge-triton serve down && bge-triton serve up ...`).",
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

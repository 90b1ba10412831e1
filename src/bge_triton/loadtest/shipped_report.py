"""The report of `bge-triton bench shipped`: shipped.md, .csv and .png (each names its command)."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from bge_triton.loadtest import report, targets
from bge_triton.loadtest.report import fmt

if TYPE_CHECKING:  # shipped imports this module lazily; no cycle at run time
    from bge_triton.loadtest.bench import BenchSettings
    from bge_triton.loadtest.shipped import ShippedRun


def _row(run, cand: str, path: str, phase: str) -> dict:
    """The quiet-hour row (phase 'low') or the saturation row (phase 'peak': the highest texts/s of the sweep)."""
    if phase == "peak":
        return targets.saturation(_peaks(run, cand, path))
    return next(r for r in run.rows if r["candidate"] == cand and r["path"] == path and r["phase"] == phase)


def _turns(run) -> str:
    """How the side-by-side quiet window was cut (from its rows)."""
    r = next((r for r in run.rows if r["path"] == "direct_delay0" and r["phase"] == "low"), None)
    return f"{r['turns']} turns of {r['turn_s']:g} s each" if r else "no turns"


def _peaks(run, cand: str, path: str) -> list[dict]:
    return [r for r in run.rows if r["candidate"] == cand and r["path"] == path and r["phase"] == "peak"]


def _sizing(run, s) -> list[str]:
    """CPU per text of the text endpoint at peak, per candidate, and the instance count it implies for 16 cores."""
    from bge_triton.loadtest.shipped import ideal

    gpu = ideal(s, run)
    out = ["| candidate | text instances | peak texts/s | texts per text-endpoint batch | server CPU-s / 1000 texts | "
           "text-endpoint stubs CPU-s / 1000 texts | texts/s one instance sustains (1 core / stub CPU per text) | "
           "instances for 16 cores |", "|---|---|---|---|---|---|---|---|"]
    for cand in run.verdicts:
        pk = _row(run, cand, "text", "peak")
        stub = targets.cpu_s_per_1000(pk["text_cores"], pk["throughput"])
        per_inst = 1000.0 / stub if stub == stub and stub > 0 else float("nan")
        n = targets.instances_for_host(gpu, per_inst) if per_inst == per_inst else "-"
        inst = next(c.text_instances for c in run.candidates if c.name == cand) or "config's"
        out.append(f"| {cand} | {inst} | {pk['throughput']:.0f} | {fmt(pk['front_batch'])} | "
                   f"{fmt(targets.cpu_s_per_1000(pk['server_cores'], pk['throughput']), 2)} | "
                   f"{fmt(stub, 2)} | {fmt(per_inst, 0)} | {n} |")
    out += ["", f"Instances = ceil(ideal GPU rate {gpu:.0f} texts/s / texts/s per instance), at least 2 (one instance "
            "tokenizes and answers while the other's sub-batches run on the encoder), at most 16 - 4 cores (4 left to "
            "Triton's front ends, batchers and the encoder's host work): `loadtest.targets.instances_for_host`. The "
            "stub rate is CPU-bound (one stub = one core); the measured texts/s of a 1-instance candidate is bound by "
            "the emulated GPU instead. A faster card: scale the GPU rate by its cost profile (--cost-a-us / "
            "--cost-b-us)."]
    return out


def _planned(run, s, n: int, overhead: int) -> float:
    """The planner's own split of text batches (pools) of n texts of this traffic, priced by the cost model."""
    return _planned_cached(tuple(run.lengths["all"]), max(1, n), overhead, s.cost)


def _scheduled(run, s, users: int, instances: int, overhead: int) -> float:
    """The shipped scheduler's policy in a closed loop of `users` over `instances` pools (loadtest.pool_estimate)."""
    return _scheduled_cached(tuple(run.lengths["all"]), users, max(1, instances), overhead, s.cost)


def _endpoint():
    """The committed text endpoint's settings and its planner / scheduler modules (imported by path, as the stub)."""
    import importlib
    import sys

    from bge_triton.server.repository import TEXT_MODEL_DIR, load_config, text_settings

    if str(TEXT_MODEL_DIR) not in sys.path:
        sys.path.insert(0, str(TEXT_MODEL_DIR))
    return (text_settings(load_config(TEXT_MODEL_DIR.parent)), importlib.import_module("text_stages"),
            importlib.import_module("text_scheduler"))


@functools.cache
def _scheduled_cached(lengths: tuple[int, ...], users: int, instances: int, overhead: int, cost) -> float:
    from bge_triton.loadtest.pool_estimate import closed_loop_rate

    st, _, scheduler = _endpoint()
    return closed_loop_rate(list(lengths), users, cost, scheduler.choose, instances=instances, budget=st.token_budget,
                            max_batch=st.sub_batch_max, multiple=st.pad_to_multiple, overhead_tokens=overhead)


@functools.cache
def _planned_cached(lengths: tuple[int, ...], n: int, overhead: int, cost) -> float:
    st, stages, _ = _endpoint()
    return targets.planned_rate(list(lengths), n, cost, stages.plan_sub_batches, st.token_budget, st.sub_batch_max,
                                st.pad_to_multiple, overhead)


def _ceiling(run, s) -> list[str]:
    """What the length mix allows at fixed text-batch sizes, and each candidate against its own batch size."""
    from bge_triton.loadtest.shipped import ideal

    out = ["| texts per text-endpoint batch (planning pool) | split_overhead_tokens | planner estimate texts/s | "
           "x ideal at max batch |", "|---|---|---|---|"]
    for n in POOLS:
        for so in (64, 628):
            rate = _planned(run, s, n, so)
            out.append(f"| {n} | {so} | {rate:.0f} | {rate / ideal(s, run):.2f} |")
    out += ["", "| candidate | peak at | text instances | peak texts/s | scheduler estimate at that C | "
            "measured / estimate | x ideal: measured / estimate |", "|---|---|---|---|---|---|---|"]
    for c in run.candidates:
        pk = _row(run, c.name, "text", "peak")
        so = c.split_overhead_tokens if c.split_overhead_tokens is not None else _committed_split()
        est = _scheduled(run, s, pk["concurrency"], pk.get("text_instances") or 1, so)
        out.append(f"| {c.name} | {pk['load']} | {pk.get('text_instances', '-')} | {pk['throughput']:.0f} | {est:.0f} "
                   "| "
                   f"{pk['throughput'] / est:.2f} | {pk['throughput'] / ideal(s, run):.2f} / "
                   f"{est / ideal(s, run):.2f} |")
    return out


POOLS = (16, 32, 64, 128, 256, 512, 1024)


def _sweep(run, s) -> list[str]:
    """Every C of the sweep: both paths' texts/s, the ratios, and the planner's ceiling for a pool of C texts."""
    from bge_triton.loadtest.shipped import ideal

    gpu, so = ideal(s, run), _committed_split()
    out = ["| candidate | C | text texts/s | tensor texts/s | text / tensor | text / ideal | planner ceiling, pool of "
           "C "
           "texts | ceiling x ideal | text / ceiling | scheduler estimate, C users over the instances' pools | "
           "text / estimate | text p50 / p99 ms | texts per text batch | encoder batch | errors text / tensor |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in run.candidates:
        so_c = c.split_overhead_tokens if c.split_overhead_tokens is not None else so
        tensor = {r["concurrency"]: r for r in _peaks(run, c.name, "tensor_buckets")}
        best = (_row(run, c.name, "text", "peak")["concurrency"], _row(run, c.name, "tensor_buckets",
                                                                       "peak")["concurrency"])
        for r in _peaks(run, c.name, "text"):
            k, tr = r["concurrency"], tensor.get(r["concurrency"], {})
            ceil, est = _planned(run, s, k, so_c), _scheduled(run, s, k, r.get("text_instances") or 1, so_c)
            mark = lambda v, b: f"**{v:.0f}**" if b else f"{v:.0f}"  # noqa: E731 - the saturation point in bold
            out.append(f"| {c.name} | {k} | {mark(r['throughput'], k == best[0])} | "
                       f"{mark(tr.get('throughput', float('nan')), k == best[1])} | "
                       f"{fmt(r['throughput'] / tr['throughput'] if tr.get('throughput') else float('nan'), 2)} | "
                       f"{r['throughput'] / gpu:.2f} | {ceil:.0f} | {ceil / gpu:.2f} | {r['throughput'] / ceil:.2f} | "
                       f"{est:.0f} | {r['throughput'] / est:.2f} | "
                       f"{fmt(r['p50_ms'])} / {fmt(r['p99_ms'])} | {fmt(r['front_batch'])} | {fmt(r['avg_batch'])} | "
                       f"{r['errors']} / {tr.get('errors', '-')} |")
    return out


def _queue_note(r: dict) -> str:
    """targets.queue_check on the called model's queue policy (the text endpoint's pools keep the same one)."""
    return targets.queue_check(r["concurrency"], r["max_queue_size"], r["queue_timeout_us"], r["throughput"]) or \
        "holds C"


def _generator(run) -> list[str]:
    """Did the load generator hold C requests in flight, and do the queue policies admit C users?"""
    out = [f"Load-generator self-check: {run.selfcheck_rps:.0f} req/s against a no-op python model at "
           f"C={max(run.concurrencies)} (same generator, one process; {run.selfcheck_unanswered} requests unanswered). "
           "Unanswered = requests the server never answered (counted grace_s after the window; "
           "docs/loadtest.md, \"The peak sweep\"). Per peak row: the client's texts/s against "
           "the server's (Triton's success count of the called model over the same window), and the requests "
           "inside Triton on average (Little: Triton's summed request time / window seconds). That count ends when "
           "a model's execute returns, so it misses texts waiting in the text endpoint's scheduler (answered later "
           "through response senders); the client side bounds what it holds back: an answer waits unread while the "
           "generator's event loop is busy (the lateness of a 10 ms timer), so about texts/s x that lag requests are "
           "out of the server, and C minus them are in it. Queue policy of the called model as loaded (the text "
           "endpoint's scheduler holds each instance's pool to the same max_queue_size and timeout), and what it "
           "implies for C users (`loadtest.targets.queue_check`).", "",
           "| candidate | path | C | client texts/s | server texts/s | in flight at the server (Triton's count) | "
           "generator loop lag ms, mean / max | held in flight (C - texts/s x mean lag) | generator cores | "
           "max_queue_size / timeout s | queue policy at C | errors | unanswered | first error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in run.rows:
        if r["phase"] != "peak":
            continue
        note = _queue_note(r)
        out.append(f"| {r['candidate']} | {r['path']} | {r['concurrency']} | {r['throughput']:.0f} | "
                   f"{fmt(r['server_rate'], 0)} | {fmt(r['server_in_flight'], 0)} | "
                   f"{fmt(r.get('loop_lag_ms'), 2)} / {fmt(r.get('loop_lag_max_ms'), 1)} | "
                   f"{fmt(r['concurrency'] - r['throughput'] * r.get('loop_lag_ms', float('nan')) / 1000.0, 0)} | "
                   f"{fmt(r['gen_cores'], 2)} | "
                   f"{r['max_queue_size']} / {r['queue_timeout_us'] / 1e6:g} | {note} | {r['errors']} | "
                   f"{r.get('unanswered', '-')} | {r['first_error'][:80] or '-'} |")
    out.append("")
    for key in dict.fromkeys((r["candidate"], r["path"]) for r in run.rows if r["phase"] == "peak"):
        rows = [r for r in run.rows if (r["candidate"], r["path"]) == key and r["phase"] == "peak"]
        bad = [r["concurrency"] for r in rows if _queue_note(r) != "holds C"]
        failed = [r["concurrency"] for r in rows if r["errors"]]
        out.append(f"- {key[0]}, {key[1]}: the queue policy " + (f"rejects at C={', '.join(map(str, bad))}" if bad
                   else "holds every C of the sweep") + (f"; errors at C={', '.join(map(str, failed))}" if failed else
                                                         "; no errors") + ".")
    return out


def _committed_split() -> int:
    return _endpoint()[0].split_overhead_tokens


def write(run: ShippedRun, s: BenchSettings) -> list[Path]:
    """Write the three files into s.out."""
    from bge_triton.loadtest.shipped import FIELDS, ideal, t1_ms

    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    m, lens = run.machine, run.lengths
    lines = [f"<!-- generated by `{run.command}`; rerun it to regenerate -->",
             "# The committed config pair, measured as shipped (EMULATED GPU)", "",
             f"Command: `{run.command}`  ",
             f"Encoder: EMULATED GPU, cost model t(B, L) = {s.cost.a_us:.0f} us + {s.cost.b_us:.2f} us x B x L "
             f"({s.cost.source}); both configs from model_repository/, the CPU variant only swaps the encoder for the "
             "cost model.  ",
             f"Traffic: {len(set(r['path'] for r in run.rows))} paths, the same 512 reviews (loadtest/corpus.py, "
             "clipped to "
             f"{s.max_chars} chars); tokens per text ([CLS]/[SEP] included, unpadded): median {lens['median']:.0f}, "
             f"mean {lens['mean']:.1f}, max {lens['max']}.  ",
             f"t(1, median L) = {t1_ms(s, run):.2f} ms; ideal throughput at max batch (64 x mean L, no padding) = "
             f"{ideal(s, run):.0f} texts/s.  ",
             f"Quiet hours: open loop at {s.low_fraction:.0%} of batch-1 capacity, {s.low_duration_s:g} s per path. "
             "The "
             f"text endpoint and the reference (a second copy of the encoder at delay 0 on its own emulated GPU, "
             "called "
             f"directly with the endpoint's own tokens) take turns in one window, {_turns(run)} (ABBA; each turn after "
             f"a 0.25 s warm-up not counted; `bench.measure_side_by_side`), so the machine's drift falls on both; the "
             f"tensor path's window after {s.warmup_s:g} s warm-up, alone. Peak = saturation: closed loops of C = "
             f"{', '.join(map(str, run.concurrencies))} "
             f"users, each path judged by its highest texts/s over the sweep (`loadtest.targets.saturation`); base "
             f"window {s.duration_s:g} s, each point's warm-up >= 1.5 rounds of its C requests and window >= 3 rounds "
             "(at the previous point's rate), at most 3x the base (`loadtest.sweep.windows`; per row in the CSV).  ",
             f"Machine: {m['cores']}-core CPU shared with other sessions, {m['server']}; load average "
             f"{m['loadavg_at_start']} at start, {run.loadavg_end} at end (noisy).", "",
             f"Pick: **{run.picked}**.", "", "## Targets", ""]
    for cand, vs in run.verdicts.items():
        lines += [f"### {cand}", "", "| target | limit | measured | peak taken at (highest over the sweep) | verdict |",
                  "|---|---|---|---|---|"]
        lines += [f"| {v['target']} | {v['sense']} {v['limit']:g} | {fmt(v['measured'], 2)} | {v.get('at') or '-'} | "
                  f"{'PASS' if v['pass'] else 'FAIL'} |" for v in vs]
        lines.append("")
    lines += ["## Rows", "", "| candidate | path | phase | load | texts/s | p50 ms | p99 ms | encoder batch | "
              "queue ms | compute ms | errors |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['candidate']} | {r['path']} | {r['phase']} | {r['load']} | {r['throughput']:.0f} | "
              f"{fmt(r['p50_ms'])} | "
              f"{fmt(r['p99_ms'])} | {fmt(r['avg_batch'])} | {fmt(r['queue_ms'])} | {fmt(r['compute_ms'])} | "
              f"{r['errors']} |"
              for r in run.rows]
    lines += ["", "## Peak sweep: every C", "",
              "Each path's saturation point in bold. The planner ceiling for a pool of C texts is the bound any "
              "scheduler faces with only C texts in the system: the text endpoint's own planner "
              "(text_stages.plan_sub_batches) splitting C texts drawn from this traffic, priced by the cost model "
              "(`loadtest.targets.planned_rate`, no server). The scheduler estimate runs the shipped scheduler's own "
              "policy (text_scheduler.choose) in a closed loop of C one-text users spread over the text endpoint's "
              "instances, one pool each (`loadtest.pool_estimate.closed_loop_rate`, no server).", ""] + _sweep(run, s)
    lines += ["", "## Load generator and queue limits at peak", ""] + _generator(run)
    lines += ["", "## What the length mix allows at peak", "",
              "The ideal at max batch assumes 64 texts of the mean length, unpadded. The text endpoint pads each "
              "sub-batch to its longest text (rounded to 8) and pays the cost model's fixed cost a per call; its "
              "planner "
              "(text_stages.plan_sub_batches) picks the cheapest split of the texts it holds. Priced by the same cost "
              "model, on the same lengths (`loadtest.targets.planned_rate`, 50 seeded pools each; no server). The "
              "sweep table's scheduler estimate (`loadtest.pool_estimate`) runs the shipped scheduler's policy "
              "(text_scheduler.choose) in a closed loop of C users over the instances' pools instead; the last table "
              "sets it beside each candidate's saturation point.", ""] + _ceiling(run, s)
    lines += ["", "## CPU cost of the text endpoint at peak", ""] + _sizing(run, s)
    lines += ["", "![quiet-hour p50 and peak texts/s per candidate](shipped.png)", ""]
    md = out / "shipped.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    csv = report.write_csv(run.rows, FIELDS, out / "shipped.csv", run.command)
    return [md, csv, _plot(run, s, out / "shipped.png")]


def _plot(run, s, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bge_triton.loadtest.shipped import ideal, t1_ms

    cands = list(run.verdicts)
    refs = [_row(run, c, "direct_delay0", "low") for c in cands]  # each candidate's side-by-side reference
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.8))
    x = range(len(cands))
    a1.bar([i - 0.2 for i in x], [_row(run, c, "text", "low")["p50_ms"] for c in cands], 0.4, label="text endpoint p50")
    a1.bar([i + 0.2 for i in x], [_row(run, c, "text", "low")["p99_ms"] for c in cands], 0.4, label="text endpoint p99")
    a1.plot([i - 0.2 for i in x], [r["p50_ms"] for r in refs], "k_", ms=28, mew=2,
            label="direct encoder, delay 0, same window: p50")
    a1.plot([i + 0.2 for i in x], [r["p99_ms"] for r in refs], "k_", ms=28, mew=1,
            label="direct encoder, delay 0, same window: p99")
    a1.axhline(t1_ms(s, run), color="r", ls="-.", label="cost model t(1, median L)")
    a1.set_ylabel("quiet-hour latency (ms)")
    a2.bar([i - 0.2 for i in x], [_row(run, c, "text", "peak")["throughput"] for c in cands], 0.4,
           label="text endpoint")
    a2.bar([i + 0.2 for i in x], [_row(run, c, "tensor_buckets", "peak")["throughput"] for c in cands], 0.4,
           label="tensor mode, client buckets")
    a2.axhline(ideal(s, run), color="r", ls="-.", label="ideal at max batch")
    a2.set_ylabel("peak texts/s (highest over the C sweep)")
    so = _committed_split()
    for k, c in enumerate(run.candidates):
        for kind, ls in (("text", "o-"), ("tensor_buckets", "s--")):
            pts = sorted((r["concurrency"], r["throughput"]) for r in _peaks(run, c.name, kind))
            a3.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=f"C{k}", label=f"{c.name}: {kind}")
    pools = sorted({*POOLS, *run.concurrencies})
    a3.plot(pools, [_planned(run, s, n, so) for n in pools], "k:",
            label=f"planner ceiling, pool of C texts (split {so})")
    a3.axhline(ideal(s, run), color="r", ls="-.", label="ideal at max batch")
    a3.set_xscale("log", base=2)
    a3.set_xlabel("closed-loop users C (texts in the system)")
    a3.set_ylabel("texts/s")
    a3.grid(True, which="both", alpha=0.3)
    a3.legend(fontsize=6)
    for ax in (a1, a2):
        ax.set_xticks(list(x), [c.replace(",", "\n") for c in cands], fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("EMULATED GPU (cost model): the committed pair and candidates", fontsize=10)
    fig.text(0.01, 0.01, f"generated by `{run.command}`", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Description": f"generated by `{run.command}`"})
    plt.close(fig)
    return path

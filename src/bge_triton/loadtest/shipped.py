"""`bge-triton bench shipped`: the committed config pair measured as shipped, against its targets (quiet-hour latency
near the encoder alone, peak texts/s near the tensor path's and the ideal batch's; loadtest/targets.py).

On the emulated GPU with the real review length mix, side by side: the text endpoint, tensor mode with the client's
buckets, and the encoder at delay 0 on the endpoint's own tokens (the quiet-hour reference); quiet hours and a peak
sweep. `--candidate` varies both configs ("committed": unchanged); `--write` commits the pick.
"""
from __future__ import annotations

import contextlib
import functools
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bge_triton import flags
from bge_triton.client.core import DEFAULT_BUCKETS, tensor_call
from bge_triton.client.tokens import BucketTokenizer
from bge_triton.loadtest import core, corpus, harness, loadgen, report, sweep, targets
from bge_triton.loadtest.core import preferred_sets
from bge_triton.loadtest.scenarios import SCENARIOS
from bge_triton.loadtest.stats import process_tree
from bge_triton.paths import REPORTS_DIR, STATE_DIR
from bge_triton.repository import (
    DEFAULT_CANONICAL,
    ENCODER_SUFFIX,
    Batching,
    batching_of,
    load_config,
    update_batching_in_place,
    update_text_settings_in_place,
)
from bge_triton.server.cpu_variant import CpuVariant

ENC, TXT, REF = harness.EMULATED + ENCODER_SUFFIX, harness.EMULATED, harness.REFERENCE
REFERENCE = "reference (encoder at delay 0)"
PAIR_DESCRIPTION = ("the encoder's batching and the text endpoint's settings tuned together against the shipped "
                    "targets (quiet-hour latency near the encoder alone, peak texts/s near the tensor path's and the "
                    "ideal batch's), on the emulated GPU")
FIELDS = ("candidate", "path", "phase", "load", "concurrency", "throughput", "avg_ms", "p50_ms", "p99_ms", "n",
          "errors", "unanswered", "avg_batch", "front_batch", "queue_ms", "compute_ms", "server_cores", "text_cores",
          "gen_cores", "server_rate", "server_in_flight", "server_failures", "ramp_s", "warmup_s", "window_s",
          "max_queue_size", "queue_timeout_us", "text_instances", "loop_lag_ms", "loop_lag_max_ms", "turns", "turn_s",
          "first_error")
KEYS = {"delay": "delay_us", "preferred": "preferred", "split": "split_overhead_tokens", "mif": "max_in_flight",
        "ti": "text_instances"}


@dataclass(frozen=True)
class Candidate:
    """A config pair: None fields keep the committed value."""

    name: str = "committed"
    delay_us: int | None = None
    preferred: tuple[int, ...] | None = None
    split_overhead_tokens: int | None = None
    max_in_flight: int | None = None
    text_instances: int | None = None

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """'committed' or e.g. 'delay=0,preferred=none,split=628,mif=1,ti=2' (preferred sizes joined by '/')."""
        values: dict = {}
        for key, _, raw in (item.strip().partition("=") for item in text.split(",") if text.strip() != "committed"):
            if key not in KEYS:
                raise SystemExit(f"--candidate {text!r}: unknown key {key!r}; use {sorted(KEYS)}")
            values[KEYS[key]] = preferred_sets(raw.replace("/", ","))[0] if key == "preferred" else int(raw)
        return cls(name=text.strip(), **values)

    def text_params(self) -> dict[str, str]:
        return {k: str(v) for k, v in (("split_overhead_tokens", self.split_overhead_tokens),
                                       ("max_in_flight", self.max_in_flight)) if v is not None}

    def batching(self) -> Batching | None:
        unset = self.delay_us is None and self.preferred is None
        return None if unset else Batching(preferred_batch_sizes=self.preferred, max_queue_delay_us=self.delay_us)


@dataclass
class ShippedRun:
    command: str
    candidates: tuple[Candidate, ...]
    concurrencies: tuple[int, ...] = (128,)
    rows: list[dict] = field(default_factory=list)
    lengths: dict = field(default_factory=dict)
    verdicts: dict = field(default_factory=dict)
    picked: str | None = None
    machine: dict = field(default_factory=dict)
    selfcheck_rps: float = 0.0  # the load generator against a no-op model at the sweep's largest C
    selfcheck_unanswered: int = 0  # its requests the server never answered (loadgen counts them after grace_s)


def _text_stub_cpu(h: harness.Harness) -> dict[int, float]:
    """CPU-seconds so far per pid of the text endpoint's python stubs (their command line names its model.py)."""
    import psutil

    out = {}
    for p in process_tree(h.live.pid)[1:]:
        with contextlib.suppress(psutil.NoSuchProcess):
            if f"/{TXT}/1/model.py" in " ".join(p.cmdline()):
                out[p.pid] = sum(p.cpu_times()[:2])
    return out


def run_shipped(s: core.BenchSettings, candidates: tuple[Candidate, ...],
                concurrencies: tuple[int, ...] = (128,)) -> ShippedRun:
    """Reference rows once, then each candidate's text and tensor rows (quiet hours + the peak sweep), on one server."""
    run = ShippedRun(s.command, candidates, concurrencies, machine=report.machine_info())
    core.ensure_real_repo(s)  # the export's tokenizer; a fresh checkout has none yet
    texts, tokenizer = corpus.sample("reviews", 512, seed=1, max_chars=s.max_chars), s.real_repo / s.real_name / "1"
    buckets = BucketTokenizer(str(tokenizer / "tokenizer"), DEFAULT_BUCKETS, max_length=512)
    own8 = BucketTokenizer(str(tokenizer / "tokenizer"), tuple(range(8, 513, 8)), max_length=512)  # the endpoint's
    lens = [len(ids) for ids in own8.token_ids(texts)]
    run.lengths = {"median": statistics.median(lens), "mean": statistics.fmean(lens), "max": max(lens), "all": lens}
    bodies = {"text": tuple(loadgen.text_request(t) for t in texts),
              "tensor_buckets": tuple(loadgen.request_body(tensor_call("", *buckets.encode([t]))) for t in texts),
              "direct_delay0": tuple(loadgen.request_body(tensor_call("", *own8.encode([t]))) for t in texts)}
    cost = {"cost_a_us": s.cost.a_us, "cost_b_us": s.cost.b_us}
    batch1 = s.cost.capacity_qps(1, run.lengths["median"])
    low_rate = s.low_fraction * batch1

    def label(rows: list[dict], cand: str, path: str, cfg) -> list[dict]:
        """The rows' candidate, path and the called model's queue policy (the text endpoint's pools keep it)."""
        knobs = batching_of(cfg)
        for r in rows:
            r.update(candidate=cand, path=path, executor="costmodel", scenario=path,
                     max_queue_size=knobs.max_queue_size, queue_timeout_us=knobs.queue_timeout_us,
                     text_cores=r.pop("probe_cores", math.nan),
                     **({"text_instances": cfg.instance_group[0].count} if path == "text" else {}))
            print(f"{cand:40s} {report.row_line(r)}  server {r.get('server_rate', math.nan):.0f}/s "
                  f"in flight {r.get('server_in_flight', math.nan):.0f}", flush=True)
        return rows

    def peaks(model: str, watch: list[str], path: str, peak_at: tuple[int, ...] = concurrencies) -> list[dict]:
        """The closed-loop sweep over peak_at (text-endpoint stubs' cores counted)."""
        def closed(users: int, warmup_s: float, duration_s: float, ramp_s: float) -> dict:
            return core.measure(h, replace(s, warmup_s=warmup_s, duration_s=duration_s), model, watch, bodies[path],
                                 "closed", users=users, ramp_s=ramp_s, probe=probe)
        return sweep.peak_sweep(closed, h.live.http_url, model, peak_at, batch1, s.warmup_s, s.duration_s)

    with core.stand(s, "shipped_repo", True, max(concurrencies), max(concurrencies) / sweep.CONNECTS_PER_S) as h:
        check, probe = h.self_check_result, functools.partial(_text_stub_cpu, h)
        run.selfcheck_rps, run.selfcheck_unanswered = (check.throughput, check.late) if check else (0.0, 0)
        # the quiet-hour reference, loaded for the whole run beside each candidate's encoder (its own emulated GPU)
        enc_variant = h.variant_for("costmodel")
        ref_cfg = h.load(REF, SCENARIOS["delay_0"], executor="costmodel", params=cost, variant=enc_variant)
        run.rows += label(peaks(REF, [REF], "direct_delay0", concurrencies[:1]), REFERENCE, "direct_delay0", ref_cfg)
        for cand in candidates:
            enc_cfg = h.load(ENC, cand.batching(), executor="costmodel", params=cost, variant=enc_variant)
            txt_cfg = h.load(TXT, params=cand.text_params(),
                             variant=CpuVariant(executor="costmodel", text_instances=cand.text_instances))
            # quiet hours: the text endpoint and the reference called directly take turns in one window
            text_low, ref_low = core.measure_side_by_side(h, s, [core.Leg(TXT, (TXT, ENC), bodies["text"]), core.Leg(
                REF, (REF,), bodies["direct_delay0"])], low_rate, probe=probe)
            label([ref_low], cand.name, "direct_delay0", ref_cfg)
            text = label([text_low, *peaks(TXT, [TXT, ENC], "text")], cand.name, "text", txt_cfg)
            h.unload(TXT)
            tensor_low = core.measure(h, s, ENC, [ENC], bodies["tensor_buckets"], "open", rate=low_rate, probe=probe)
            tensor = label([tensor_low, *peaks(ENC, [ENC], "tensor_buckets")], cand.name, "tensor_buckets", enc_cfg)
            run.rows += [ref_low, *text, *tensor]
            run.verdicts[cand.name] = targets.verdicts(text[0], text[1:], ref_low, tensor[1:], t1_ms(s, run),
                                                       ideal(s, run))
    run.picked = targets.pick(list(run.verdicts.items()))
    return run


def t1_ms(s: core.BenchSettings, run: ShippedRun) -> float:
    return s.cost.batch_ms(1, run.lengths["median"])


def ideal(s: core.BenchSettings, run: ShippedRun) -> float:
    return targets.ideal_rate(s.cost, load_config(DEFAULT_CANONICAL / ENC).max_batch_size, run.lengths["mean"])


def write_pick(cand: Candidate, canonical: Path = DEFAULT_CANONICAL) -> list[Path]:
    """Commit a candidate's values into both configs through the schema (comments kept)."""
    batching = cand.batching()
    return ([update_batching_in_place(canonical / ENC, batching)] if batching is not None else []) + [
        update_text_settings_in_place(canonical / TXT, cand.text_instances,
                                      **{k: int(v) for k, v in cand.text_params().items()})]


# -- the report: shipped.md, .csv, .png ------------------------------------------------------------------------------
POOLS = (16, 32, 64, 128, 256, 512, 1024)
fmt = report.fmt


def _peaks(run: ShippedRun, cand: str, path: str) -> list[dict]:
    return [r for r in run.rows if r["candidate"] == cand and r["path"] == path and r["phase"] == "peak"]


def _row(run: ShippedRun, cand: str, path: str, phase: str) -> dict:
    """The quiet-hour row (phase 'low') or the saturation row (phase 'peak': the highest texts/s of the sweep)."""
    if phase == "peak":
        return targets.saturation(_peaks(run, cand, path))
    return next(r for r in run.rows if r["candidate"] == cand and r["path"] == path and r["phase"] == phase)


def _estimate(run: ShippedRun, s: core.BenchSettings, n: int, overhead: int | None, instances: int = 0) -> float:
    """texts/s on this length mix priced by the cost model, no server: the planner's split of pools of n texts
    (targets.planned_rate), or with `instances` the scheduler's closed loop of n users (targets.closed_loop_rate);
    overhead None: the committed split_overhead_tokens."""
    return _priced(tuple(run.lengths["all"]), n, instances, overhead, s.cost)


@functools.cache
def _priced(lengths: tuple[int, ...], n: int, instances: int, overhead: int | None, cost) -> float:
    st, stages, scheduler, _ = targets.endpoint()
    so = st.split_overhead_tokens if overhead is None else overhead
    if instances:
        return targets.closed_loop_rate(list(lengths), n, cost, scheduler.choose, instances=instances,
                                        budget=st.token_budget, max_batch=st.sub_batch_max,
                                        multiple=st.pad_to_multiple, overhead_tokens=so)
    return targets.planned_rate(list(lengths), max(1, n), cost, stages.plan_sub_batches, st.token_budget,
                                st.sub_batch_max, st.pad_to_multiple, so)


def _queue_note(r: dict) -> str:
    """targets.queue_check on the called model's queue policy (the text endpoint's pools keep the same one)."""
    return targets.queue_check(r["concurrency"], r["max_queue_size"], r["queue_timeout_us"], r["throughput"]) or \
        "holds C"


def _sweep_rows(run: ShippedRun, s: core.BenchSettings) -> list[list]:
    """Every C of the sweep: both paths' texts/s, the ratios, the planner's ceiling and the scheduler's estimate."""
    gpu, out = ideal(s, run), []
    mark = lambda v, b: f"**{v:.0f}**" if b else f"{v:.0f}"  # noqa: E731 - the saturation point in bold
    for c in run.candidates:
        tensor, so = {r["concurrency"]: r for r in _peaks(run, c.name, "tensor_buckets")}, c.split_overhead_tokens
        best = (_row(run, c.name, "text", "peak")["concurrency"],
                _row(run, c.name, "tensor_buckets", "peak")["concurrency"])
        for r in _peaks(run, c.name, "text"):
            k, tr = r["concurrency"], tensor.get(r["concurrency"], {})
            ceil, est = _estimate(run, s, k, so), _estimate(run, s, k, so, r.get("text_instances") or 1)
            out.append([c.name, k, mark(r["throughput"], k == best[0]),
                        mark(tr.get("throughput", math.nan), k == best[1]),
                        fmt(r["throughput"] / tr["throughput"] if tr.get("throughput") else math.nan, 2),
                        f"{r['throughput'] / gpu:.2f}", f"{ceil:.0f}", f"{ceil / gpu:.2f}",
                        f"{r['throughput'] / ceil:.2f}", f"{est:.0f}", f"{r['throughput'] / est:.2f}",
                        f"{fmt(r['p50_ms'])} / {fmt(r['p99_ms'])}", r["front_batch"], r["avg_batch"],
                        f"{r['errors']} / {tr.get('errors', '-')}"])
    return out


def _candidate_rows(run: ShippedRun, s: core.BenchSettings) -> tuple[list[list], list[list]]:
    """Each candidate at its text peak: against the scheduler's estimate, and its CPU per text with the instance
    count that implies for 16 cores."""
    gpu, ceiling, sizing = ideal(s, run), [], []
    for c in run.candidates:
        pk = _row(run, c.name, "text", "peak")
        est = _estimate(run, s, pk["concurrency"], c.split_overhead_tokens, pk.get("text_instances") or 1)
        ceiling.append([c.name, pk["load"], pk.get("text_instances", "-"), f"{pk['throughput']:.0f}", f"{est:.0f}",
                        f"{pk['throughput'] / est:.2f}", f"{pk['throughput'] / gpu:.2f} / {est / gpu:.2f}"])
        stub = targets.cpu_s_per_1000(pk["text_cores"], pk["throughput"])
        per_inst = 1000.0 / stub if stub == stub and stub > 0 else math.nan
        sizing.append([c.name, c.text_instances or "config's", f"{pk['throughput']:.0f}", pk["front_batch"],
                       fmt(targets.cpu_s_per_1000(pk["server_cores"], pk["throughput"]), 2), fmt(stub, 2),
                       fmt(per_inst, 0), targets.instances_for_host(gpu, per_inst) if per_inst == per_inst else "-"])
    return ceiling, sizing


TABLES = {  # name -> header; the rows come from the functions above
    "targets": "target | limit | measured | peak taken at (highest over the sweep) | verdict",
    "rows": "candidate | path | phase | load | texts/s | p50 ms | p99 ms | encoder batch | queue ms | compute ms | "
            "errors",
    "sweep": "candidate | C | text texts/s | tensor texts/s | text / tensor | text / ideal | planner ceiling, pool of "
             "C texts | ceiling x ideal | text / ceiling | scheduler estimate, C users over the instances' pools | "
             "text / estimate | text p50 / p99 ms | texts per text batch | encoder batch | errors text / tensor",
    "generator": "candidate | path | C | client texts/s | server texts/s | in flight at the server (Triton's count) | "
                 "generator loop lag ms, mean / max | held in flight (C - texts/s x mean lag) | generator cores | "
                 "max_queue_size / timeout s | queue policy at C | errors | unanswered | first error",
    "pools": "texts per text-endpoint batch (planning pool) | split_overhead_tokens | planner estimate texts/s | "
             "x ideal at max batch",
    "ceiling": "candidate | peak at | text instances | peak texts/s | scheduler estimate at that C | "
               "measured / estimate | x ideal: measured / estimate",
    "sizing": "candidate | text instances | peak texts/s | texts per text-endpoint batch | server CPU-s / 1000 texts | "
              "text-endpoint stubs CPU-s / 1000 texts | texts/s one instance sustains (1 core / stub CPU per text) | "
              "instances for 16 cores",
}


def write_report(run: ShippedRun, s: core.BenchSettings) -> list[Path]:
    """shipped.md, shipped.csv, shipped.png in s.out (the reasoning behind each table: docs/loadtest.md)."""
    out, m, lens = Path(s.out), run.machine, run.lengths
    peak = [r for r in run.rows if r["phase"] == "peak"]
    ref = next((r for r in run.rows if r["path"] == "direct_delay0" and r["phase"] == "low"), None)
    turns = f"{ref['turns']} turns of {ref['turn_s']:g} s each" if ref else "no turns"
    lines = [*report.header(m),
             f"Encoder: EMULATED GPU, cost model t(B, L) = {s.cost.a_us:.0f} us + {s.cost.b_us:.2f} us x B x L "
             f"({s.cost.source}); both configs from model_repository/, the CPU variant only swaps the encoder for the "
             "cost model.  ",
             f"Traffic: {len(set(r['path'] for r in run.rows))} paths, the same 512 reviews (clipped to {s.max_chars} "
             f"chars); tokens per text (unpadded): median {lens['median']:.0f}, mean {lens['mean']:.1f}, max "
             f"{lens['max']}.  ",
             f"t(1, median L) = {t1_ms(s, run):.2f} ms; ideal throughput at max batch (64 x mean L, no padding) = "
             f"{ideal(s, run):.0f} texts/s.  ",
             f"Quiet hours: open loop at {s.low_fraction:.0%} of batch-1 capacity, {s.low_duration_s:g} s per path; "
             f"the text endpoint and the reference (the encoder at delay 0, its own copy) take turns in one window, "
             f"{turns} (ABBA, `core.measure_side_by_side`). Peak = saturation: closed loops of C = "
             f"{', '.join(map(str, run.concurrencies))} users, each path judged by its highest texts/s "
             f"(`loadtest.targets.saturation`); base window {s.duration_s:g} s, per point `loadtest.sweep.windows`.  ",
             "",
             f"Pick: **{run.picked}**.", "", "## Targets", ""]
    for cand, vs in run.verdicts.items():
        lines += [f"### {cand}", "", *report.table(TABLES["targets"], (
            [v["target"], f"{v['sense']} {v['limit']:g}", fmt(v["measured"], 2), v.get("at") or "-",
             "PASS" if v["pass"] else "FAIL"] for v in vs)), ""]
    lines += ["## Rows", "", *report.table(TABLES["rows"], (
        [r["candidate"], r["path"], r["phase"], r["load"], f"{r['throughput']:.0f}", r["p50_ms"], r["p99_ms"],
         r["avg_batch"], r["queue_ms"], r["compute_ms"], r["errors"]] for r in run.rows))]
    lines += ["", "## Peak sweep: every C", "", "Each path's saturation point in bold. Planner ceiling: the text "
              "endpoint's planner splitting pools of C texts of this traffic (`loadtest.targets.planned_rate`); "
              "scheduler estimate: the shipped policy in a closed loop of C users over the instances' pools "
              "(`loadtest.targets.closed_loop_rate`); both priced by the cost model, no server.", "",
              *report.table(TABLES["sweep"], _sweep_rows(run, s))]
    generator = [[r["candidate"], r["path"], r["concurrency"], f"{r['throughput']:.0f}", fmt(r["server_rate"], 0),
                  fmt(r["server_in_flight"], 0), f"{fmt(r.get('loop_lag_ms'), 2)} / {fmt(r.get('loop_lag_max_ms'), 1)}",
                  fmt(r["concurrency"] - r["throughput"] * r.get("loop_lag_ms", math.nan) / 1000.0, 0),
                  fmt(r["gen_cores"], 2), f"{r['max_queue_size']} / {r['queue_timeout_us'] / 1e6:g}", _queue_note(r),
                  r["errors"], r.get("unanswered", "-"), r["first_error"][:80] or "-"] for r in peak]
    lines += ["", "## Load generator and queue limits at peak", "",
              f"Load-generator self-check: {run.selfcheck_rps:.0f} req/s against a no-op python model at "
              f"C={max(run.concurrencies)} ({run.selfcheck_unanswered} requests unanswered). Server texts/s and in "
              "flight: Triton's statistics of the called model over the row's window; queue policy at C: "
              "`loadtest.targets.queue_check` (docs/loadtest.md, \"The peak sweep\").", "",
              *report.table(TABLES["generator"], generator), ""]
    for key in dict.fromkeys((r["candidate"], r["path"]) for r in peak):
        rows = [r for r in peak if (r["candidate"], r["path"]) == key]
        bad = [str(r["concurrency"]) for r in rows if _queue_note(r) != "holds C"]
        failed = [str(r["concurrency"]) for r in rows if r["errors"]]
        lines.append(f"- {key[0]}, {key[1]}: the queue policy " + (f"rejects at C={', '.join(bad)}" if bad else
                     "holds every C of the sweep") + (f"; errors at C={', '.join(failed)}." if failed else
                                                      "; no errors."))
    gpu, (ceiling, sizing) = ideal(s, run), _candidate_rows(run, s)
    pools = [[n, so, f"{_estimate(run, s, n, so):.0f}", f"{_estimate(run, s, n, so) / gpu:.2f}"]
             for n in POOLS for so in (64, 628)]
    lines += ["", "## What the length mix allows at peak", "", *report.table(TABLES["pools"], pools), "",
              *report.table(TABLES["ceiling"], ceiling)]
    lines += ["", "## CPU cost of the text endpoint at peak", "", *report.table(TABLES["sizing"], sizing),
              "", f"Instances = ceil(ideal GPU rate {ideal(s, run):.0f} texts/s / texts/s per instance), at least 2, "
              "at most 16 - 4 cores (`loadtest.targets.instances_for_host`).",
              "", "![quiet-hour p50 and peak texts/s per candidate](shipped.png)"]
    return [report.write_md(out / "shipped.md", run.command,
                            "The committed config pair, measured as shipped (EMULATED GPU)", lines),
            report.write_csv(run.rows, FIELDS, out / "shipped.csv", run.command), _plot(run, s, out / "shipped.png")]


def _plot(run: ShippedRun, s: core.BenchSettings, path: Path) -> Path:
    cands, x = list(run.verdicts), range(len(run.verdicts))
    fig, (a1, a2, a3) = report.subplots(3, 17 / 3)
    for ax, key, path_, phase, dx, label in (
            (a1, "p50_ms", "text", "low", -0.2, "text endpoint p50"), (a1, "p99_ms", "text", "low", 0.2,
                                                                       "text endpoint p99"),
            (a2, "throughput", "text", "peak", -0.2, "text endpoint"),
            (a2, "throughput", "tensor_buckets", "peak", 0.2, "tensor mode, client buckets")):
        ax.bar([i + dx for i in x], [_row(run, c, path_, phase)[key] for c in cands], 0.4, label=label)
    for key, dx, mew in (("p50_ms", -0.2, 2), ("p99_ms", 0.2, 1)):  # each candidate's side-by-side reference
        a1.plot([i + dx for i in x], [_row(run, c, "direct_delay0", "low")[key] for c in cands], "k_", ms=28, mew=mew,
                label=f"direct encoder, delay 0, same window: {key[:3]}")
    a1.axhline(t1_ms(s, run), color="r", ls="-.", label="cost model t(1, median L)")
    a1.set_ylabel("quiet-hour latency (ms)")
    a2.set_ylabel("peak texts/s (highest over the C sweep)")
    so = targets.endpoint()[0].split_overhead_tokens
    for k, c in enumerate(run.candidates):
        for kind, ls in (("text", "o-"), ("tensor_buckets", "s--")):
            pts = sorted((r["concurrency"], r["throughput"]) for r in _peaks(run, c.name, kind))
            a3.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=f"C{k}", label=f"{c.name}: {kind}")
    pools = sorted({*POOLS, *run.concurrencies})
    a3.plot(pools, [_estimate(run, s, n, so) for n in pools], "k:",
            label=f"planner ceiling, pool of C texts (split {so})")
    a3.set(xlabel="closed-loop users C (texts in the system)", ylabel="texts/s")
    a3.set_xscale("log", base=2)
    for ax in (a2, a3):
        ax.axhline(ideal(s, run), color="r", ls="-.", label="ideal at max batch")
    a3.grid(True, which="both", alpha=0.3)
    a3.legend(fontsize=6)
    for ax in (a1, a2):
        ax.set_xticks(list(x), [c.replace(",", "\n") for c in cands], fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("EMULATED GPU (cost model): the committed pair and candidates", fontsize=10)
    return report.save_figure(fig, path, run.command)


def pair_candidates(delays_us: str, preferred: str, split: str, max_in_flight: str, instances: str = "") -> list[str]:
    """The grid of `tune pair` as --candidate strings ('committed' first: it wins ties)."""
    return ["committed"] + [f"delay={int(d)},preferred={'/'.join(map(str, pref)) or 'none'},split={int(so)},"
                            f"mif={int(mif)}" + (f",ti={int(ti)}" if ti else "")
                            for d in delays_us.split(",") for pref in preferred_sets(preferred)
                            for so in split.split(",") for mif in max_in_flight.split(",")
                            for ti in (instances.split(",") if instances else [""])]


def parse_args(argv: list[str] | None = None, pair: bool = False) -> tuple[core.BenchSettings, tuple[Candidate, ...],
                                                                           Path | None, tuple[int, ...]]:
    """The flags of `bench shipped`, or (pair) of `tune pair`: the same run over a grid of candidate pairs."""
    prog = "bge-triton tune pair" if pair else "bge-triton bench shipped"
    p = flags.parser(prog, PAIR_DESCRIPTION if pair else __doc__.split("\n\n")[0])
    core.add_flags(p, ("quick", False, "short windows (about 3 minutes per candidate)"))
    d = core.BenchSettings(out=REPORTS_DIR / ("tune/pair" if pair else "bench/shipped"),
                            state_dir=STATE_DIR / "loadtest" / ("tune_pair_state" if pair else "shipped_state"))
    core.add_common_flags(p, d)
    if pair:
        core.add_flags(p, ("delays-us", "0,5000", "encoder max_queue_delay candidates"),
                        ("preferred", "none;16,32", "encoder preferred-size sets, ';'-separated"),
                        ("split-overhead", "64,628", "text endpoint split_overhead_tokens candidates"),
                        ("max-in-flight", "1,2", "text endpoint max_in_flight candidates"),
                        ("instances", "", "text endpoint instance counts (default: the config's)"))
    else:
        flags.no_env(p.add_argument(
            "--candidate", action="append", default=[], help="'committed' (default) or key=value,... "
            f"with keys {sorted(KEYS)}; repeatable; the first listed wins ties"),
            "a candidate holds commas; give each as --candidate")
    # 128 = 2 x the encoder's max batch (with 64 texts in the system the GPU idles while a full batch returns);
    # larger pools let the planner group similar lengths (targets.planned_rate): peak is their saturation
    core.add_flags(p, ("write", False, "commit the pick into --target-repo (both configs)"),
                    ("target-repo", DEFAULT_CANONICAL, "repository --write updates", Path))
    p.add_argument("--peak-concurrency", type=sweep.parse_concurrency, default=sweep.DEFAULT_SWEEP, metavar="C,C,...",
                   help=f"closed-loop users per peak point (default {sweep.DEFAULT_SWEEP}); each path's peak = its "
                   "highest texts/s over them")
    core.add_flags(p, ("duration", None, "base seconds per peak window (default 8, quick 3; a point at a larger C is "
                                          "lengthened to 3 rounds of its C requests, at most 3x)", float))
    a = flags.parse(p, argv)
    dur = a.duration or (3.0 if a.quick else 8.0)
    s = core.from_flags(a, d, f"{prog} " + " ".join(argv if argv is not None else sys.argv[1:]),
                         concurrency=max(a.peak_concurrency), warmup_s=0.5 if a.quick else 2.0, duration_s=dur,
                         low_duration_s=2 * dur)
    grid = pair_candidates(a.delays_us, a.preferred, a.split_overhead, a.max_in_flight, a.instances) if pair else \
        a.candidate or ["committed"]
    return s, tuple(Candidate.parse(c) for c in grid), a.target_repo if a.write else None, a.peak_concurrency


def main(argv: list[str] | None = None, pair: bool = False) -> int:
    s, cands, target, concurrencies = parse_args(argv, pair)
    t0 = time.monotonic()
    run = run_shipped(s, cands, concurrencies)
    paths = write_report(run, s)
    if target is not None and run.picked:
        cand = next(c for c in cands if c.name == run.picked)
        paths += write_pick(cand, target)
        print(f"wrote the pick {cand.name!r} into", ", ".join(map(str, paths[-2:])))
    print(f"shipped done in {time.monotonic() - t0:.0f} s; pick:", run.picked, "|", ", ".join(map(str, paths)))
    return 0


def pair_main(argv: list[str]) -> int:
    """`bge-triton tune pair`: the encoder's batching AND the text endpoint's settings against the shipped targets."""
    return main(argv, pair=True)

"""`bge-triton bench shipped`: the committed config pair measured as shipped, against issue 14's targets.

On the emulated GPU (the encoder = cost model, loadtest/costmodel.py) with the real review length mix, side by
side in one run: (a) the text endpoint, (b) tensor mode to the encoder with the client's length buckets, (c) the
encoder called directly with the text endpoint's own tokens at delay 0 (the quiet-hour reference); quiet hours
(open loop, 20% of batch-1 capacity) and peak (closed loop). Candidate pairs (`--candidate`) vary the encoder's
batching and the text endpoint's settings; "committed" loads both configs unchanged. `--write` commits the pick.
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bge_triton.client.core import DEFAULT_BUCKETS, tensor_call
from bge_triton.client.tokens import BucketTokenizer
from bge_triton.loadtest import bench, corpus, harness, loadgen, report, sweep, targets
from bge_triton.paths import REPORTS_DIR, STATE_DIR
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.repository import (
    DEFAULT_CANONICAL,
    ENCODER_SUFFIX,
    SCENARIOS,
    Batching,
    batching_of,
    load_config,
    update_batching_in_place,
    update_text_settings_in_place,
)

ENC, TXT, REF = harness.EMULATED + ENCODER_SUFFIX, harness.EMULATED, harness.REFERENCE
REFERENCE = "reference (encoder at delay 0)"
FIELDS = ("candidate", "path", "phase", "load", "concurrency", "throughput", "avg_ms", "p50_ms", "p99_ms", "n",
          "errors",
          "unanswered", "avg_batch", "front_batch", "queue_ms", "compute_ms", "server_cores", "text_cores", "gen_cores",
          "server_rate", "server_in_flight", "server_failures", "ramp_s", "warmup_s", "window_s", "max_queue_size",
          "queue_timeout_us", "text_instances", "loop_lag_ms", "loop_lag_max_ms", "turns", "turn_s", "first_error")
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
        if text.strip() == "committed":
            return cls()
        values: dict = {}
        for item in text.split(","):
            key, _, raw = item.partition("=")
            if key.strip() not in KEYS:
                raise SystemExit(f"--candidate {text!r}: unknown key {key!r}; use {sorted(KEYS)}")
            if key.strip() == "preferred":
                values["preferred"] = () if raw in ("none", "") else tuple(int(v) for v in raw.split("/"))
            else:
                values[KEYS[key.strip()]] = int(raw)
        return cls(name=text.strip(), **values)

    def text_params(self) -> dict[str, str]:
        return {k: str(v) for k, v in (("split_overhead_tokens", self.split_overhead_tokens),
                                       ("max_in_flight", self.max_in_flight)) if v is not None}

    def batching(self) -> Batching | None:
        if self.delay_us is None and self.preferred is None:
            return None
        return Batching(preferred_batch_sizes=self.preferred, max_queue_delay_us=self.delay_us)


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
    loadavg_end: str = ""
    selfcheck_rps: float = 0.0  # the load generator against a no-op model at the sweep's largest C
    selfcheck_unanswered: int = 0  # its requests the server never answered (loadgen counts them after grace_s)


def _text_stub_cpu(h: harness.Harness) -> dict[int, float]:
    """CPU-seconds so far per pid of the text endpoint's python stubs (their command line names its model.py)."""
    import psutil

    out = {}
    for p in psutil.Process(h.live.pid).children(recursive=True):
        try:
            if f"/{TXT}/1/model.py" in " ".join(p.cmdline()):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return out


def _measure(h, s, model, watch, bodies, mode, rate=0.0, users=64, ramp_s=0.0) -> dict:
    """bench.measure plus the text-endpoint stubs' cores busy over the window (text_cores)."""
    c0, t0 = _text_stub_cpu(h), time.monotonic()
    row = bench.measure(h, s, model, watch, bodies, mode, rate=rate, users=users, ramp_s=ramp_s)
    c1 = _text_stub_cpu(h)
    row["text_cores"] = sum(v - c0.get(pid, 0.0) for pid, v in c1.items()) / (time.monotonic() - t0)
    return row


def _bodies(tokenizer: Path, texts: list[str]) -> tuple[dict, dict]:
    """Request bodies per path, and the token-length profile of the texts."""
    buckets = BucketTokenizer(str(tokenizer), DEFAULT_BUCKETS, max_length=512)
    own8 = BucketTokenizer(str(tokenizer), tuple(range(8, 513, 8)), max_length=512)  # the endpoint's padding
    lens = [len(ids) for ids in own8.token_ids(texts)]
    bodies = {"text": tuple(loadgen.text_request(t) for t in texts),
              "tensor_buckets": tuple(loadgen.request_body(tensor_call("", *buckets.encode([t]))) for t in texts),
              "direct_delay0": tuple(loadgen.request_body(tensor_call("", *own8.encode([t]))) for t in texts)}
    return bodies, {"median": statistics.median(lens), "mean": statistics.fmean(lens), "max": max(lens), "all": lens}


def run_shipped(s: bench.BenchSettings, candidates: tuple[Candidate, ...],
                concurrencies: tuple[int, ...] = (128,)) -> ShippedRun:
    """Reference rows once, then each candidate's text and tensor rows (quiet hours + the peak sweep), on one server."""
    bench.ensure_real_repo(s)
    repo_dir = s.state_dir.parent / "shipped_repo"
    harness.build_repository(repo_dir, s.real_repo, s.real_name, s.command)
    run = ShippedRun(s.command, candidates, concurrencies, machine=report.machine_info())
    texts = corpus.sample("reviews", 512, seed=1, max_chars=s.max_chars)
    bodies, run.lengths = _bodies(s.real_repo / s.real_name / "1" / "tokenizer", texts)
    cost = {"cost_a_us": s.cost.a_us, "cost_b_us": s.cost.b_us}
    batch1 = s.cost.capacity_qps(1, run.lengths["median"])
    h = harness.Harness(repo_dir, s.state_dir, s.cost).start()
    enc_variant = h.variant_for("costmodel")

    def quiet_pair(cand: str, txt_cfg, ref_cfg) -> tuple[dict, dict]:
        """Quiet hours of the text endpoint and of the reference encoder called directly, taking turns in one window."""
        text, ref = bench.measure_side_by_side(
            h, s, [bench.Leg(TXT, (TXT, ENC), bodies["text"]), bench.Leg(REF, (REF,), bodies["direct_delay0"])],
            s.low_fraction * batch1, probe=lambda: _text_stub_cpu(h))
        text["text_cores"], ref["text_cores"] = text.pop("probe_cores"), ref.pop("probe_cores")
        for r, path, cfg in ((text, "text", txt_cfg), (ref, "direct_delay0", ref_cfg)):
            label(r, cand, path, cfg)
        return text, ref

    def label(r: dict, cand: str, path: str, cfg) -> None:
        knobs = batching_of(cfg)  # the text endpoint's scheduler holds its pools to the same queue policy
        pools = {"text_instances": cfg.instance_group[0].count} if path == "text" else {}
        r.update(candidate=cand, path=path, executor="costmodel", scenario=path, max_queue_size=knobs.max_queue_size,
                 queue_timeout_us=knobs.queue_timeout_us, **pools)
        print(f"{cand:40s} {report.row_line(r)}  server {r.get('server_rate', float('nan')):.0f}/s "
              f"in flight {r.get('server_in_flight', float('nan')):.0f}", flush=True)

    def peaks(cand: str, path: str, model: str, watch: list[str], body: tuple[bytes, ...], cfg,
              peak_at: tuple[int, ...]) -> list[dict]:
        """The closed-loop sweep over peak_at; the called model's queue policy noted."""
        closed = lambda users, warmup_s, duration_s, ramp_s: _measure(  # noqa: E731
            h, replace(s, warmup_s=warmup_s, duration_s=duration_s), model, watch, body, "closed", users=users,
            ramp_s=ramp_s)
        rows = sweep.peak_sweep(closed, h.live.http_url, model, peak_at, batch1, s.warmup_s, s.duration_s)
        for r in rows:
            label(r, cand, path, cfg)
        return rows

    try:
        run.selfcheck_rps = h.self_check(max(concurrencies), max(2.0, s.duration_s / 2),
                                         ramp_s=max(concurrencies) / sweep.CONNECTS_PER_S)
        run.selfcheck_unanswered = h.self_check_result.late if h.self_check_result else 0
        print(f"load-generator self-check: {run.selfcheck_rps:.0f} req/s against the no-op model at C="
              f"{max(concurrencies)}, {run.selfcheck_unanswered} unanswered", flush=True)
        # the quiet-hour reference, loaded for the whole run beside each candidate's encoder (its own emulated GPU)
        ref_cfg = h.load(REF, SCENARIOS["delay_0"], executor="costmodel", params=cost, variant=enc_variant)
        run.rows += peaks(REFERENCE, "direct_delay0", REF, [REF], bodies["direct_delay0"], ref_cfg,
                          concurrencies[:1])  # one peak row for scale
        for cand in candidates:
            enc_cfg = h.load(ENC, cand.batching(), executor="costmodel", params=cost, variant=enc_variant)
            txt_cfg = h.load(TXT, params=cand.text_params(),
                             variant=CpuVariant(executor="costmodel", text_instances=cand.text_instances))
            text_low, ref_low = quiet_pair(cand.name, txt_cfg, ref_cfg)
            text = [text_low] + peaks(cand.name, "text", TXT, [TXT, ENC], bodies["text"], txt_cfg, concurrencies)
            h.unload(TXT)
            tensor_low = _measure(h, s, ENC, [ENC], bodies["tensor_buckets"], "open", rate=s.low_fraction * batch1)
            label(tensor_low, cand.name, "tensor_buckets", enc_cfg)
            tensor = [tensor_low] + peaks(cand.name, "tensor_buckets", ENC, [ENC], bodies["tensor_buckets"], enc_cfg,
                                          concurrencies)
            run.rows += [ref_low] + text + tensor
            run.verdicts[cand.name] = targets.verdicts(text[0], text[1:], ref_low, tensor[1:], t1_ms(s, run),
                                                       ideal(s, run))
    finally:
        h.stop()
    run.picked = targets.pick(list(run.verdicts.items()))
    run.loadavg_end = report.machine_info()["loadavg_at_start"]
    return run


def t1_ms(s: bench.BenchSettings, run: ShippedRun) -> float:
    return s.cost.batch_ms(1, run.lengths["median"])


def ideal(s: bench.BenchSettings, run: ShippedRun) -> float:
    return targets.ideal_rate(s.cost, load_config(DEFAULT_CANONICAL / ENC).max_batch_size, run.lengths["mean"])


def write_pick(cand: Candidate, canonical: Path = DEFAULT_CANONICAL) -> list[Path]:
    """Commit a candidate's values into both configs through the schema (comments kept)."""
    paths = []
    batching = cand.batching()
    if batching is not None:
        paths.append(update_batching_in_place(canonical / ENC, batching))
    paths.append(update_text_settings_in_place(canonical / TXT, cand.text_instances, **{
        k: int(v) for k, v in cand.text_params().items()}))
    return paths


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


def _endpoint():
    """The committed text endpoint's settings and its planner / scheduler modules (imported by path, as the stub)."""
    import importlib

    from bge_triton.server.repository import TEXT_MODEL_DIR, text_settings

    if str(TEXT_MODEL_DIR) not in sys.path:
        sys.path.insert(0, str(TEXT_MODEL_DIR))
    return (text_settings(load_config(TEXT_MODEL_DIR.parent)), importlib.import_module("text_stages"),
            importlib.import_module("text_scheduler"))


@functools.cache
def _estimate(lengths: tuple[int, ...], n: int, instances: int, overhead: int, cost, closed_loop: bool) -> float:
    """texts/s on this length mix, priced by the cost model, no server: the planner's own split of pools of n texts
    (targets.planned_rate), or the shipped scheduler's policy in a closed loop of n users over `instances` pools
    (targets.closed_loop_rate)."""
    st, stages, scheduler = _endpoint()
    if closed_loop:
        return targets.closed_loop_rate(list(lengths), n, cost, scheduler.choose, instances=max(1, instances),
                                budget=st.token_budget, max_batch=st.sub_batch_max, multiple=st.pad_to_multiple,
                                overhead_tokens=overhead)
    return targets.planned_rate(list(lengths), max(1, n), cost, stages.plan_sub_batches, st.token_budget,
                                st.sub_batch_max, st.pad_to_multiple, overhead)


def _planned(run: ShippedRun, s: bench.BenchSettings, n: int, overhead: int) -> float:
    return _estimate(tuple(run.lengths["all"]), n, 1, overhead, s.cost, False)


def _scheduled(run: ShippedRun, s: bench.BenchSettings, users: int, instances: int, overhead: int) -> float:
    return _estimate(tuple(run.lengths["all"]), users, instances, overhead, s.cost, True)


def _split(c: Candidate) -> int:
    return c.split_overhead_tokens if c.split_overhead_tokens is not None else _endpoint()[0].split_overhead_tokens


def _queue_note(r: dict) -> str:
    """targets.queue_check on the called model's queue policy (the text endpoint's pools keep the same one)."""
    return targets.queue_check(r["concurrency"], r["max_queue_size"], r["queue_timeout_us"], r["throughput"]) or \
        "holds C"


def _sweep_rows(run: ShippedRun, s: bench.BenchSettings) -> list[list]:
    """Every C of the sweep: both paths' texts/s, the ratios, the planner's ceiling and the scheduler's estimate."""
    gpu, out = ideal(s, run), []
    for c in run.candidates:
        tensor = {r["concurrency"]: r for r in _peaks(run, c.name, "tensor_buckets")}
        best = (_row(run, c.name, "text", "peak")["concurrency"],
                _row(run, c.name, "tensor_buckets", "peak")["concurrency"])
        for r in _peaks(run, c.name, "text"):
            k, tr = r["concurrency"], tensor.get(r["concurrency"], {})
            ceil, est = _planned(run, s, k, _split(c)), _scheduled(run, s, k, r.get("text_instances") or 1, _split(c))
            mark = lambda v, b: f"**{v:.0f}**" if b else f"{v:.0f}"  # noqa: E731 - the saturation point in bold
            out.append([c.name, k, mark(r["throughput"], k == best[0]),
                        mark(tr.get("throughput", math.nan), k == best[1]),
                        fmt(r["throughput"] / tr["throughput"] if tr.get("throughput") else math.nan, 2),
                        f"{r['throughput'] / gpu:.2f}", f"{ceil:.0f}", f"{ceil / gpu:.2f}",
                        f"{r['throughput'] / ceil:.2f}", f"{est:.0f}", f"{r['throughput'] / est:.2f}",
                        f"{fmt(r['p50_ms'])} / {fmt(r['p99_ms'])}", r["front_batch"], r["avg_batch"],
                        f"{r['errors']} / {tr.get('errors', '-')}"])
    return out


def _generator_rows(run: ShippedRun) -> list[list]:
    return [[r["candidate"], r["path"], r["concurrency"], f"{r['throughput']:.0f}", fmt(r["server_rate"], 0),
             fmt(r["server_in_flight"], 0), f"{fmt(r.get('loop_lag_ms'), 2)} / {fmt(r.get('loop_lag_max_ms'), 1)}",
             fmt(r["concurrency"] - r["throughput"] * r.get("loop_lag_ms", math.nan) / 1000.0, 0),
             fmt(r["gen_cores"], 2), f"{r['max_queue_size']} / {r['queue_timeout_us'] / 1e6:g}", _queue_note(r),
             r["errors"], r.get("unanswered", "-"), r["first_error"][:80] or "-"]
            for r in run.rows if r["phase"] == "peak"]


def _policy_lines(run: ShippedRun) -> list[str]:
    out = []
    for key in dict.fromkeys((r["candidate"], r["path"]) for r in run.rows if r["phase"] == "peak"):
        rows = [r for r in run.rows if (r["candidate"], r["path"]) == key and r["phase"] == "peak"]
        bad = [r["concurrency"] for r in rows if _queue_note(r) != "holds C"]
        failed = [r["concurrency"] for r in rows if r["errors"]]
        out.append(f"- {key[0]}, {key[1]}: the queue policy " + (f"rejects at C={', '.join(map(str, bad))}" if bad
                   else "holds every C of the sweep") + (f"; errors at C={', '.join(map(str, failed))}" if failed
                                                         else "; no errors") + ".")
    return out


def _sizing_rows(run: ShippedRun, s: bench.BenchSettings) -> list[list]:
    """CPU per text of the text endpoint at peak, per candidate, and the instance count it implies for 16 cores."""
    out = []
    for c in run.candidates:
        pk = _row(run, c.name, "text", "peak")
        stub = targets.cpu_s_per_1000(pk["text_cores"], pk["throughput"])
        per_inst = 1000.0 / stub if stub == stub and stub > 0 else math.nan
        n = targets.instances_for_host(ideal(s, run), per_inst) if per_inst == per_inst else "-"
        out.append([c.name, c.text_instances or "config's", f"{pk['throughput']:.0f}", pk["front_batch"],
                    fmt(targets.cpu_s_per_1000(pk["server_cores"], pk["throughput"]), 2), fmt(stub, 2),
                    fmt(per_inst, 0), n])
    return out


def _ceiling_rows(run: ShippedRun, s: bench.BenchSettings) -> tuple[list[list], list[list]]:
    """What the length mix allows at fixed text-batch sizes, and each candidate against its own batch size."""
    gpu = ideal(s, run)
    pools = [[n, so, f"{_planned(run, s, n, so):.0f}", f"{_planned(run, s, n, so) / gpu:.2f}"]
             for n in POOLS for so in (64, 628)]
    cands = []
    for c in run.candidates:
        pk = _row(run, c.name, "text", "peak")
        est = _scheduled(run, s, pk["concurrency"], pk.get("text_instances") or 1, _split(c))
        cands.append([c.name, pk["load"], pk.get("text_instances", "-"), f"{pk['throughput']:.0f}", f"{est:.0f}",
                      f"{pk['throughput'] / est:.2f}", f"{pk['throughput'] / gpu:.2f} / {est / gpu:.2f}"])
    return pools, cands


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


def write_report(run: ShippedRun, s: bench.BenchSettings) -> list[Path]:
    """shipped.md, shipped.csv, shipped.png in s.out."""
    out, m, lens = Path(s.out), run.machine, run.lengths
    ref = next((r for r in run.rows if r["path"] == "direct_delay0" and r["phase"] == "low"), None)
    turns = f"{ref['turns']} turns of {ref['turn_s']:g} s each" if ref else "no turns"
    lines = [f"Encoder: EMULATED GPU, cost model t(B, L) = {s.cost.a_us:.0f} us + {s.cost.b_us:.2f} us x B x L "
             f"({s.cost.source}); both configs from model_repository/, the CPU variant only swaps the encoder for the "
             "cost model.  ",
             f"Traffic: {len(set(r['path'] for r in run.rows))} paths, the same 512 reviews (loadtest/corpus.py, "
             f"clipped to {s.max_chars} chars); tokens per text ([CLS]/[SEP] included, unpadded): median "
             f"{lens['median']:.0f}, mean {lens['mean']:.1f}, max {lens['max']}.  ",
             f"t(1, median L) = {t1_ms(s, run):.2f} ms; ideal throughput at max batch (64 x mean L, no padding) = "
             f"{ideal(s, run):.0f} texts/s.  ",
             f"Quiet hours: open loop at {s.low_fraction:.0%} of batch-1 capacity, {s.low_duration_s:g} s per path. "
             "The text endpoint and the reference (a second copy of the encoder at delay 0 on its own emulated GPU, "
             f"called directly with the endpoint's own tokens) take turns in one window, {turns} (ABBA; each turn "
             "after a 0.25 s warm-up not counted; `bench.measure_side_by_side`), so the machine's drift falls on "
             f"both; the tensor path's window after {s.warmup_s:g} s warm-up, alone. Peak = saturation: closed loops "
             f"of C = {', '.join(map(str, run.concurrencies))} users, each path judged by its highest texts/s over the "
             f"sweep (`loadtest.targets.saturation`); base window {s.duration_s:g} s, each point's warm-up >= 1.5 "
             "rounds of its C requests and window >= 3 rounds (at the previous point's rate), at most 3x the base "
             "(`loadtest.sweep.windows`; per row in the CSV).  ",
             f"Machine: {m['cores']}-core CPU shared with other sessions, {m['server']}; load average "
             f"{m['loadavg_at_start']} at start, {run.loadavg_end} at end (noisy).", "",
             f"Pick: **{run.picked}**.", "", "## Targets", ""]
    for cand, vs in run.verdicts.items():
        lines += [f"### {cand}", "", *report.table(TABLES["targets"], (
            [v["target"], f"{v['sense']} {v['limit']:g}", fmt(v["measured"], 2), v.get("at") or "-",
             "PASS" if v["pass"] else "FAIL"] for v in vs)), ""]
    lines += ["## Rows", "", *report.table(TABLES["rows"], (
        [r["candidate"], r["path"], r["phase"], r["load"], f"{r['throughput']:.0f}", r["p50_ms"], r["p99_ms"],
         r["avg_batch"], r["queue_ms"], r["compute_ms"], r["errors"]] for r in run.rows))]
    lines += ["", "## Peak sweep: every C", "",
              "Each path's saturation point in bold. The planner ceiling for a pool of C texts is the bound any "
              "scheduler faces with only C texts in the system: the text endpoint's own planner "
              "(text_stages.plan_sub_batches) splitting C texts drawn from this traffic, priced by the cost model "
              "(`loadtest.targets.planned_rate`, no server). The scheduler estimate runs the shipped scheduler's own "
              "policy (text_scheduler.choose) in a closed loop of C one-text users spread over the text endpoint's "
              "instances, one pool each (`loadtest.targets.closed_loop_rate`, no server).", "",
              *report.table(TABLES["sweep"], _sweep_rows(run, s))]
    lines += ["", "## Load generator and queue limits at peak", "",
              f"Load-generator self-check: {run.selfcheck_rps:.0f} req/s against a no-op python model at "
              f"C={max(run.concurrencies)} (same generator, one process; {run.selfcheck_unanswered} requests "
              "unanswered, counted grace_s after the window). Per peak row: the client's texts/s against Triton's "
              "success count of the called model over the same window; the requests inside Triton (Little: summed "
              "request time / window; it misses texts waiting in the text endpoint's scheduler); the generator's "
              "event-loop lag (an answer waits unread that long, so about texts/s x lag requests are out of the "
              "server); the called model's queue policy and what it implies for C users "
              "(`loadtest.targets.queue_check`). docs/loadtest.md, \"The peak sweep\", has the reasoning.", "",
              *report.table(TABLES["generator"], _generator_rows(run)), "", *_policy_lines(run)]
    pools, cands = _ceiling_rows(run, s)
    lines += ["", "## What the length mix allows at peak", "",
              "The ideal at max batch assumes 64 texts of the mean length, unpadded; the text endpoint pads each "
              "sub-batch to its longest text (rounded to 8) and pays the fixed cost a per call. Planner estimate: "
              "its own split (text_stages.plan_sub_batches) of pools of n texts of these lengths, priced by the cost "
              "model (`loadtest.targets.planned_rate`, 50 seeded pools; no server); the second table sets the "
              "scheduler estimate (`loadtest.targets.closed_loop_rate`) beside each candidate's saturation point.", "",
              *report.table(TABLES["pools"], pools), "", *report.table(TABLES["ceiling"], cands)]
    lines += ["", "## CPU cost of the text endpoint at peak", "", *report.table(TABLES["sizing"], _sizing_rows(run, s)),
              "", f"Instances = ceil(ideal GPU rate {ideal(s, run):.0f} texts/s / texts/s per instance), at least 2 "
              "(one instance tokenizes and answers while the other's sub-batches run on the encoder), at most 16 - 4 "
              "cores (4 left to Triton's front ends, batchers and the encoder's host work): "
              "`loadtest.targets.instances_for_host`. The stub rate is CPU-bound (one stub = one core); the measured "
              "texts/s of a 1-instance candidate is bound by the emulated GPU instead. A faster card: scale the GPU "
              "rate by its cost profile (--cost-a-us / --cost-b-us).",
              "", "![quiet-hour p50 and peak texts/s per candidate](shipped.png)"]
    return [report.write_md(out / "shipped.md", run.command,
                            "The committed config pair, measured as shipped (EMULATED GPU)", lines),
            report.write_csv(run.rows, FIELDS, out / "shipped.csv", run.command), _plot(run, s, out / "shipped.png")]


def _plot(run: ShippedRun, s: bench.BenchSettings, path: Path) -> Path:
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
    so = _endpoint()[0].split_overhead_tokens
    for k, c in enumerate(run.candidates):
        for kind, ls in (("text", "o-"), ("tensor_buckets", "s--")):
            pts = sorted((r["concurrency"], r["throughput"]) for r in _peaks(run, c.name, kind))
            a3.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=f"C{k}", label=f"{c.name}: {kind}")
    pools = sorted({*POOLS, *run.concurrencies})
    a3.plot(pools, [_planned(run, s, n, so) for n in pools], "k:",
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


def parse_args(argv: list[str] | None = None) -> tuple[bench.BenchSettings, tuple[Candidate, ...], Path | None,
                                                     tuple[int, ...]]:
    p = argparse.ArgumentParser(prog="bge-triton bench shipped", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows (about 3 minutes per candidate)")
    d = bench.BenchSettings(out=REPORTS_DIR / "bench" / "shipped", state_dir=STATE_DIR / "loadtest" / "shipped_state")
    bench.add_common_flags(p, d)
    p.add_argument("--candidate", action="append", default=[], help="'committed' (default) or key=value,... "
                   f"with keys {sorted(KEYS)}; repeatable; the first listed wins ties")
    p.add_argument("--write", action="store_true", help="commit the pick into --target-repo (both configs)")
    p.add_argument("--target-repo", type=Path, default=DEFAULT_CANONICAL, help="repository --write updates")
    # 128 = 2 x the encoder's max batch (with 64 texts in the system the GPU idles while a full batch returns);
    # larger pools let the planner group similar lengths (targets.planned_rate): peak is their saturation
    p.add_argument("--peak-concurrency", type=sweep.parse_concurrency, default=sweep.DEFAULT_SWEEP, metavar="C,C,...",
                   help=f"closed-loop users per peak point (default {sweep.DEFAULT_SWEEP}); each path's peak = its "
                   "highest texts/s over them")
    p.add_argument("--duration", type=float, help="base seconds per peak window (default 8, quick 3; a point at a "
                   "larger C is lengthened to 3 rounds of its C requests, at most 3x)")
    a = p.parse_args(argv)
    dur = a.duration or (3.0 if a.quick else 8.0)
    cmd = "bge-triton bench shipped " + " ".join(argv if argv is not None else sys.argv[1:])
    s = replace(d, concurrency=max(a.peak_concurrency), warmup_s=0.5 if a.quick else 2.0, duration_s=dur,
                low_duration_s=2 * dur, state_dir=a.state_dir, real_repo=a.real_repo, real_name=a.real_name,
                command=cmd.strip(), out=a.out, cost=bench.cost_model(a.cost_a_us, a.cost_b_us))
    cands = tuple(Candidate.parse(c) for c in (a.candidate or ["committed"]))
    return s, cands, a.target_repo if a.write else None, a.peak_concurrency


def main(argv: list[str] | None = None) -> int:
    s, cands, target, concurrencies = parse_args(argv)
    t0 = time.monotonic()
    run = run_shipped(s, cands, concurrencies)
    paths = write_report(run, s)
    if target is not None and run.picked:
        cand = next(c for c in cands if c.name == run.picked)
        paths += write_pick(cand, target)
        print(f"wrote the pick {cand.name!r} into", ", ".join(map(str, paths[-2:])))
    print(f"shipped done in {time.monotonic() - t0:.0f} s; pick:", run.picked, "|", ", ".join(map(str, paths)))
    return 0

"""`bge-triton bench shipped`: the committed config pair measured as shipped, against issue 14's targets.

On the emulated GPU (the encoder = cost model, loadtest/costmodel.py) with the real review length mix, side by
side in one run: (a) the text endpoint, (b) tensor mode to the encoder with the client's length buckets, (c) the
encoder called directly with the text endpoint's own tokens at delay 0 (the quiet-hour reference); quiet hours
(open loop, 20% of batch-1 capacity) and peak (closed loop). Candidate pairs (`--candidate`) vary the encoder's
batching and the text endpoint's settings; "committed" loads both configs unchanged. `--write` commits the pick.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bge_triton.client.core import DEFAULT_BUCKETS, tensor_call
from bge_triton.client.tokens import BucketTokenizer
from bge_triton.loadtest import bench, corpus, harness, loadgen, report, sweep, targets
from bge_triton.loadtest.costmodel import DEFAULT as DEFAULT_COST
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


def parse_args(argv: list[str] | None = None) -> tuple[bench.BenchSettings, tuple[Candidate, ...], Path | None,
                                                     tuple[int, ...]]:
    p = argparse.ArgumentParser(prog="bge-triton bench shipped", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows (about 3 minutes per candidate)")
    p.add_argument("--out", type=Path, default=REPORTS_DIR / "bench" / "shipped", help="report directory")
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
    p.add_argument("--state-dir", type=Path, default=STATE_DIR / "loadtest" / "shipped_state")
    p.add_argument("--real-repo", type=Path, default=bench.BenchSettings.real_repo, help="export lending the tokenizer")
    p.add_argument("--real-name", default=bench.BenchSettings.real_name, help="model name in --real-repo")
    a = p.parse_args(argv)
    dur = a.duration or (3.0 if a.quick else 8.0)
    cmd = "bge-triton bench shipped " + " ".join(argv if argv is not None else sys.argv[1:])
    s = replace(bench.BenchSettings(), concurrency=max(a.peak_concurrency), warmup_s=0.5 if a.quick else 2.0,
                duration_s=dur, low_duration_s=2 * dur, state_dir=a.state_dir, real_repo=a.real_repo,
                real_name=a.real_name, command=cmd.strip(), out=a.out, cost=DEFAULT_COST)
    cands = tuple(Candidate.parse(c) for c in (a.candidate or ["committed"]))
    return s, cands, a.target_repo if a.write else None, a.peak_concurrency


def main(argv: list[str] | None = None) -> int:
    from bge_triton.loadtest import shipped_report

    s, cands, target, concurrencies = parse_args(argv)
    t0 = time.monotonic()
    run = run_shipped(s, cands, concurrencies)
    paths = shipped_report.write(run, s)
    if target is not None and run.picked:
        cand = next(c for c in cands if c.name == run.picked)
        paths += write_pick(cand, target)
        print(f"wrote the pick {cand.name!r} into", ", ".join(map(str, paths[-2:])))
    print(f"shipped done in {time.monotonic() - t0:.0f} s; pick:", run.picked, "|", ", ".join(map(str, paths)))
    return 0

"""`bge-triton bench seed`: the seed table reproduced on a real local Triton, each scenario at
peak (closed loop) and at low load (open-loop Poisson at ~20% of batch-1 capacity), side by side.

Rows run on the real exported model (ONNX Runtime, CPU) and on the cost model (EMULATED GPU); writes OUT/bench.md,
.csv, .png. The stand-up and the measurement are the harness core's (loadtest.core).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from bge_triton import flags
from bge_triton.client.core import DEFAULT_BUCKETS, tensor_call
from bge_triton.client.tokens import BucketTokenizer
from bge_triton.extras import require
from bge_triton.loadtest import corpus, engine, harness, loadgen, report
from bge_triton.loadtest.core import (
    EXECUTORS,
    SCENARIO_ORDER,
    BenchRun,
    BenchSettings,
    add_common_flags,
    add_flags,
    ensure_real_repo,
    from_flags,
    measure,
    stand,
)
from bge_triton.loadtest.scenarios import SCENARIOS
from bge_triton.repository import ENCODER_SUFFIX
from bge_triton.server.cpu_variant import CpuVariant

require("loadtest", "bge-triton bench seed")

# Opt-in (--scenarios): one review per request, padded to the SDK's length bucket or to its own length, encoder at
# delay 0: Triton batches only equal shapes, so the second batches far less (docs/benchmarks.md).
TENSOR_MIX = {"tensor_buckets": DEFAULT_BUCKETS, "tensor_own_length": tuple(range(1, 513))}


def scenario_bodies(s: BenchSettings, scenario: str, seq_len: int) -> tuple[bytes, ...]:
    """The request bodies of one bench scenario: tensor rows of seq_len tokens, a length-bucketed mix, or texts."""
    if scenario in TENSOR_MIX:
        ensure_real_repo(s)  # the export's tokenizer
        tok = BucketTokenizer(str(s.real_repo / s.real_name / "1" / "tokenizer"), TENSOR_MIX[scenario])
        rows = (tok.encode([t]) for t in corpus.sample("reviews", 512, seed=1, max_chars=s.max_chars))
        return tuple(loadgen.request_body(tensor_call("", ids, mask)) for ids, mask in rows)
    if not {"text_endpoint", *TENSOR_MIX} & set(s.scenarios):  # no texts on the chart: seeded token rows
        return tuple(loadgen.tensor_bodies(seq_len, 128))
    # one chart, one traffic: the text endpoint gets reviews of at most seq_len tokens, the tensor rows the same
    # reviews tokenized and padded to seq_len (one shape, as Triton batches)
    ensure_real_repo(s)
    texts = engine.load_texts(s.real_repo / s.real_name / "1" / "tokenizer", seq_len, 256)
    if scenario == "text_endpoint":
        return tuple(loadgen.text_request(t) for t in texts.texts)
    return tuple(loadgen.request_body(tensor_call("", texts.ids[i:i + 1], texts.mask[i:i + 1]))
                 for i in range(len(texts.texts)))


def run_executor(h: harness.Harness, s: BenchSettings, executor: str, run: BenchRun) -> None:
    """All scenarios of one executor; batch-1 capacity (no_batching peak) sets the low-load rate."""
    emu = executor == "costmodel"
    txt = harness.EMULATED if emu else s.real_name
    enc, params = txt + ENCODER_SUFFIX, {"cost_a_us": s.cost.a_us, "cost_b_us": s.cost.b_us} if emu else {}
    users, seq_len = (s.concurrency, s.seq_len) if emu else (s.real_concurrency, s.real_seq_len)
    # the emulated GPU: canonical instance counts unless overridden
    enc_variant = h.variant_for(executor, encoder_instances=s.encoder_instances) if emu else None
    batch1 = None
    for scenario in s.scenarios:
        model, watch, win = enc, [enc], s
        # the text endpoint: on CPU the variant's (in-process encoder) at delay 0; emulated: both committed configs
        # as shipped, only the encoder swapped for the cost model (as `bench shipped` measures them)
        knobs = SCENARIOS["delay_0" if scenario in (*TENSOR_MIX, "text_endpoint") else scenario]
        if scenario == "static_32":  # batches of 32 at most here, as the seed's static batcher formed them
            knobs = replace(knobs, max_batch_size=32) if knobs else knobs
        h.load(enc, None if emu and scenario == "text_endpoint" else knobs, executor=executor, params=params,
               variant=enc_variant)
        if scenario == "text_endpoint":
            h.load(txt, params=s.text_params if emu else {},
                   variant=CpuVariant(executor="costmodel", text_instances=s.text_instances) if emu else None)
            model, watch = txt, [txt, enc]
            # slower per request (tokenize + BLS): a window must hold several batches
            win = replace(s, warmup_s=max(s.warmup_s, 1.5), duration_s=max(s.duration_s, 3.0),
                          low_duration_s=max(s.low_duration_s, 3.0))
        bodies = scenario_bodies(s, scenario, seq_len)
        peak = measure(h, win, model, watch, bodies, "closed", users=users)
        if batch1 is None:
            batch1 = peak["throughput"] if scenario == "no_batching" else s.cost.capacity_qps(1, s.seq_len)
        cap1 = batch1
        if scenario == "text_endpoint":  # other texts than the tensor rows: its own batch-1 capacity (one user)
            cap1 = measure(h, replace(win, duration_s=win.duration_s / 2), model, watch, bodies, "closed",
                           users=1)["throughput"]
        low = measure(h, win, model, watch, bodies, "open", rate=max(1.0, s.low_fraction * cap1))
        for row in (peak, low):
            row.update(executor=executor, scenario=scenario, model=model,
                       label="EMULATED (cost model)" if executor == "costmodel" else f"real ({s.real_model}, ORT CPU)")
            run.rows.append(row)
            print(report.row_line(row), flush=True)
        if scenario == "text_endpoint":
            h.unload(txt)
    h.unload(enc)


def run_bench(s: BenchSettings) -> BenchRun:
    """Start the server, self-check the generator, run every executor's scenarios, stop."""
    real = "onnxruntime" in s.executors or bool({"text_endpoint", *TENSOR_MIX} & set(s.scenarios))
    run = BenchRun(s, machine=report.machine_info())
    with stand(s, "bench_repo", real, s.concurrency) as h:
        run.selfcheck_rps = h.self_check_result.throughput if h.self_check_result else 0.0
        for executor in s.executors:
            run_executor(h, s, executor, run)
    return run


SEED_ROWS = (  # DESIGN.md: published, one NVIDIA A10G, BGE-Large-zh, Python asyncio batcher
    ("no batching (batch 1)", 145, 6.8, 14.2, "18% GPU"),
    ("static full batch 32, no timeout", 1200, 85.0, 240.0, "82% GPU"),
    ("dynamic batching, 5 ms window", 1180, 8.2, 16.5, "79% GPU"),
)
FIELDS = ("executor", "label", "scenario", "model", "phase", "load", "throughput", "avg_ms", "p50_ms", "p99_ms", "n",
          "errors", "avg_batch", "front_batch", "queue_ms", "compute_ms", "cpu_pct", "server_cores", "gen_cores",
          "first_error")
# the seed table: one line per scenario, peak (closed loop) beside low load (open loop); base = no_batching peak
TABLE = ("scenario | peak req/s | x batch-1 | peak p50 / p99 ms | peak batch | peak req batch | "
         "low-load rate | avg ms | p50 ms | p99 ms | low batch | low queue ms | low compute ms | "
         "CPU % server / generator (peak) | errors")
PANEL_TITLES = {"costmodel": "EMULATED GPU (cost model)", "onnxruntime": "real model, ONNX Runtime on CPU"}


def write_report(run: BenchRun, out: Path) -> list[Path]:
    """bench.md, bench.csv, bench.png in `out`."""
    s, m, rows, f = run.settings, run.machine, run.rows, report.fmt
    peak_max = max((r["throughput"] for r in rows if r["phase"] == "peak"), default=0.0)
    lines = [*report.header(m),
             f"Windows: warm-up {s.warmup_s:g} s, peak {s.duration_s:g} s (closed loop, C={s.concurrency} emulated / "
             f"{s.real_concurrency} real), low load {s.low_duration_s:g} s (open-loop Poisson at {s.low_fraction:.0%} "
             "of the batch-1 capacity measured in this run; latency from the scheduled send time).  ",
             f"Load-generator self-check: **{run.selfcheck_rps:.0f} req/s** against a no-op python model (C="
             f"{s.concurrency}, {s.processes} process(es)). Highest peak below: {peak_max:.0f} req/s"
             + (" - **over half the generator ceiling: those rows may be generator-bound**."
                if peak_max > 0.5 * run.selfcheck_rps else " - under half the ceiling, not generator-bound."), "",
             "## Published seed figures (another machine: one NVIDIA A10G; not measured here)", "",
             *report.table("scenario (published, A10G, another machine) | throughput | avg latency | P99 | util",
                           [(n, f"{q} QPS", f"{a} ms", f"{p} ms", u) for n, q, a, p, u in SEED_ROWS]), ""]
    for ex in dict.fromkeys(r["executor"] for r in rows):
        lines += [f"## EMULATED GPU: cost model t(B,L) = {s.cost.a_us:.0f} us + {s.cost.b_us:.2f} us x B x L "
                  f"({s.cost.source}), BGE-Large-zh configs", "",
                  "EMULATED: the encoder sleeps t(B,L) per Triton batch; batching, queueing and statistics are the "
                  "real Triton ones (the python backend's overhead on these shared cores adds to compute; ideal at "
                  f"batch 32: {s.cost.capacity_qps(32, s.seq_len):.0f} req/s).", ""] if ex == "costmodel" else [
            f"## Real model: {s.real_model} ({s.real_name}, fp32) on ONNX Runtime, CPU", "",
            "On 2 CPU cores batching adds little throughput (DESIGN.md): read the ratios, not absolute times.", ""]
        peaks = {r["scenario"]: r for r in rows if r["executor"] == ex and r["phase"] == "peak"}
        lows = {r["scenario"]: r for r in rows if r["executor"] == ex and r["phase"] == "low"}
        base = peaks.get("no_batching", {}).get("throughput") or math.nan
        lines += report.table(TABLE, [
            [pk["scenario"], f"{pk['throughput']:.0f}", f(pk["throughput"] / base, 2),
             f"{f(pk['p50_ms'])} / {f(pk['p99_ms'])}", pk["avg_batch"], pk["front_batch"], lo.get("load", "-"),
             lo.get("avg_ms"), lo.get("p50_ms"), lo.get("p99_ms"), lo.get("avg_batch"), lo.get("queue_ms"),
             lo.get("compute_ms"), f"{f(100 * pk['server_cores'], 0)} / {f(100 * pk['gen_cores'], 0)}",
             pk["errors"] + lo.get("errors", 0)] for sc, pk in peaks.items() for lo in [lows.get(sc, {})]]) + [""]
    lines += ["Columns: peak = closed loop, low = open loop; `x batch-1` = peak / no_batching peak; queue = the called "
              "model's; compute and batch = the encoder's (/v2/models/<m>/stats deltas; req batch = the called "
              "model's); CPU % = CPU seconds per second x 100 of the tritonserver tree / this generator (machine-wide "
              f"% in the CSV). Tensor requests: {s.seq_len} tokens (emulated), {s.real_seq_len} (real); text_endpoint:"
              " the same reviews as the tensor rows, one per request, encoder at delay 0, low load at "
              f"{s.low_fraction:.0%}"
              " of its own one-user rate; tensor_buckets / tensor_own_length: one review padded to its SDK length "
              "bucket / own length (docs/loadtest.md).", "", "![latency vs throughput](bench.png)", ""]
    if errs := [r for r in rows if r["first_error"]]:
        lines += ["First error per row with errors:", "",
                  *(f"- {r['executor']} {r['scenario']} {r['phase']}: `{r['first_error']}`" for r in errs)]
    seed = ([q for _, q, *_ in SEED_ROWS], [p for *_, p, _ in SEED_ROWS], "seed (published A10G, P99)")
    return [report.write_md(out / "bench.md", s.command, "Bench: the seed table on a real local Triton", lines),
            report.write_csv(rows, FIELDS, out / "bench.csv", s.command),
            report.plot_p99(rows, out / "bench.png", s.command, PANEL_TITLES, marks={"costmodel": seed})]


def parse_args(argv: list[str] | None = None) -> BenchSettings:
    d = BenchSettings()
    p = flags.parser("bge-triton bench seed", __doc__.split("\n\n")[0],
                                epilog="On a Triton you run: `bge-triton bench seed --url HOST:PORT --help` "
                                "(docs/tuning.md).")
    add_flags(p, ("quick", False, "short windows (about a minute or two in all)"))
    add_common_flags(p, d)
    add_flags(p, ("executor", ",".join(EXECUTORS), "onnxruntime, costmodel, or both (comma list)"),
              ("scenarios", ",".join(SCENARIO_ORDER), f"comma list of {SCENARIO_ORDER}, or the opt-in "
               f"{tuple(TENSOR_MIX)} (the committed pair as shipped is its own scenario: `bge-triton bench shipped`)"),
              ("real-model", d.real_model, "model to export if --real-repo lacks it"),
              ("seq-len", d.seq_len, "tokens per request in tensor scenarios (seed: 64)"),
              ("concurrency", d.concurrency, "closed-loop users at peak (emulated rows)"),
              ("real-seq-len", d.real_seq_len, "tokens per request in real-model tensor rows"),
              ("real-concurrency", d.real_concurrency, "closed-loop users at peak (real rows)"),
              ("processes", d.processes, "load-generator processes"),
              ("threads", 0, "ONNX Runtime intra-op threads (0 = default)"),
              ("encoder-instances", None, "emulated rows: encoder instances (default: the config's)"),
              ("text-instances", None, "emulated rows: text-endpoint instances (default: config's)"),
              ("low-fraction", 0.2, "low-load rate as a fraction of batch-1 capacity"),
              ("duration", None, "seconds per peak window (default 10, quick 1.5)", float))
    p.add_argument("--text-param", action="append", default=[], metavar="KEY=VALUE",
                   help="emulated rows: a text-endpoint parameter, e.g. max_in_flight=2")
    p.add_argument("--no-cpu-lock", dest="cpu_lock", action="store_false",
                   help="real rows: one instance per ONNX Runtime model, no shared CPU lock (as `server up "
                   "--no-cpu-lock`)")
    a = flags.parse(p, argv)
    dur = a.duration or (1.5 if a.quick else 10.0)
    return from_flags(a, d, "bge-triton bench seed " + " ".join(argv if argv is not None else sys.argv[1:]),
                      executors=tuple(e for e in a.executor.split(",") if e), scenarios=tuple(a.scenarios.split(",")),
                      warmup_s=0.5 if a.quick else 2.0, duration_s=dur, low_duration_s=dur * 1.5,
                      intra_op_threads=a.threads, text_params=dict(kv.partition("=")[::2] for kv in a.text_param),
                      **{k: getattr(a, k) for k in ("real_model", "seq_len", "concurrency", "real_seq_len",
                                                    "real_concurrency", "low_fraction", "processes", "cpu_lock",
                                                    "encoder_instances", "text_instances")})


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # the load-generator processes print as they go
    s = parse_args(sys.argv[1:] if argv is None else list(argv))
    if bad := [e for e in s.executors if e not in EXECUTORS]:
        raise SystemExit(f"unknown executor {bad[0]!r}: choose from {EXECUTORS}")
    if bad := [sc for sc in s.scenarios if sc not in SCENARIO_ORDER and sc not in TENSOR_MIX]:
        raise SystemExit(f"unknown scenario {bad[0]!r}: choose from {SCENARIO_ORDER + tuple(TENSOR_MIX)} "
                         "(the committed pair as shipped: `bge-triton bench shipped`)")
    t0 = time.monotonic()
    paths = write_report(run_bench(s), s.out)
    print(f"bench done in {time.monotonic() - t0:.0f} s: " + ", ".join(str(p) for p in paths))
    return 0

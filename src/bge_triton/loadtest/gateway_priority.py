"""`bge-triton bench gateway-priority --repository DIR --model NAME --out reports/gateway`:
do online queries keep their latency while a bulk indexing job floods the same Triton?

One local tritonserver on the emulated GPU (the cost-model encoder: a fixed time per batch plus a
time per token), the shipped text endpoint (priority_levels 2), and two gateways in front of it:
one as shipped (queries level 1, passages level 2) and one with --query-priority 2 (everything on
one level). Per gateway: query latency one at a time on a quiet server, then the same while
--flood callers send passage batches of --flood-batch texts without pause (a closed-loop indexing
job), in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bge_triton.loadtest.gateway_harness import bench_main, gateway_process, local_server, texts
from bge_triton.loadtest.report import machine_line, write_csv
from bge_triton.loadtest.stats import percentile

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bge-triton bench gateway-priority", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, required=True, help="an exported model repository")
    p.add_argument("--model", default="bge_large_zh", help="text endpoint NAME in it")
    p.add_argument("--out", type=Path, default=Path("reports/gateway"))
    p.add_argument("--queries", type=int, default=200, help="queries per measurement, one at a time")
    p.add_argument("--flood", type=int, default=16, help="bulk callers sending passages without pause")
    p.add_argument("--flood-batch", type=int, default=16, help="passages per bulk request")
    return p


async def _queries(post: Any, items: list[str], triton_ms: list[float] | None = None) -> list[float]:
    """Queries one at a time: client latencies (ms); the gateway's x-inference-time into triton_ms."""
    lat = []
    for text in items:
        t0 = time.perf_counter()
        headers = await post({"input": text, "input_type": "query"})
        lat.append((time.perf_counter() - t0) * 1e3)
        if triton_ms is not None:
            triton_ms.append(float(headers["x-inference-time"]))
    return lat


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Quiet query latency, then query latency under the bulk flood; passages/s of the flood."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.flood * 2 + 4)) as http:
        async def post(body: dict[str, Any]) -> Any:
            async with http.post(url + "/v1/embeddings", json={"model": args.model, **body}) as r:
                r.raise_for_status()
                await r.read()
                return r.headers

        await _queries(post, texts(20))  # warm up
        quiet = await _queries(post, texts(args.queries))
        stop, done = asyncio.Event(), [0]
        passages = texts(args.flood_batch * 8)

        async def bulk(i: int) -> None:
            while not stop.is_set():
                start = (i * args.flood_batch) % len(passages)
                await post({"input": (passages * 2)[start:start + args.flood_batch]})
                done[0] += args.flood_batch

        flood = [asyncio.create_task(bulk(i)) for i in range(args.flood)]
        await asyncio.sleep(2.0)  # let the queue fill
        t0, before = time.perf_counter(), done[0]
        triton_ms: list[float] = []
        loaded = await _queries(post, texts(args.queries), triton_ms)
        rate = (done[0] - before) / (time.perf_counter() - t0)
        stop.set()
        await asyncio.gather(*flood)
    return {"quiet_p50_ms": percentile(quiet, 50), "quiet_p99_ms": percentile(quiet, 99),
            "flood_p50_ms": percentile(loaded, 50), "flood_p99_ms": percentile(loaded, 99),
            "p99_ratio": percentile(loaded, 99) / percentile(quiet, 99),
            "flood_triton_p50_ms": percentile(triton_ms, 50), "flood_passages_per_s": rate}


def _run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    from bge_triton.server.cpu_variant import CpuVariant

    rows: list[dict[str, Any]] = []
    with local_server(args.repository, CpuVariant(executor="costmodel"), tmp / "server") as srv:
        for label, flags in (("queries level 1, passages level 2 (shipped)", []),
                             ("one level for all (--query-priority 2)", ["--query-priority=2"])):
            with gateway_process(srv.grpc_url, tmp / f"gateway-{len(rows)}.log", model=args.model,
                                 repository=args.repository, flags=flags) as (_, url):
                print(f"[bench_priority] {label} ...", flush=True)
                rows.append({"gateway": label, **asyncio.run(measure(args, url))})
    return rows


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], command: str, load: str) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0])
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    write_csv([{k: fmt(r[k]) for k in fields} for r in rows], fields, args.out / "gateway_priority.csv", command)
    lines = [f"<!-- generated by `{command}`; rerun it to regenerate -->",
             "# Online queries under a bulk indexing flood, with and without Triton priority levels", "",
             f"- command: `{command}`", f"- machine: {machine_line()}; load average at start {load}; shared (noisy)",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- server: local tritonserver 2.51, text endpoint `{args.model}` as shipped, encoder = emulated GPU "
             "(cost model)", f"- flood: {args.flood} callers x {args.flood_batch} passages per request, no pause; "
             f"queries: {args.queries} one at a time, input_type=query", "",
             "| gateway | " + " | ".join(fields[1:]) + " |", "|---|" + "---|" * (len(fields) - 1)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in fields) + " |" for r in rows]
    lines += ["", "Issue 15's target: query p99 under the flood within 2x its quiet p99 (p99_ratio <= 2).", ""]
    path = args.out / "gateway_priority.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("bge_triton.loadtest.gateway_priority", build_parser(), argv, _run, write_report)

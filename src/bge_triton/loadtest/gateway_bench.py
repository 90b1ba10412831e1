"""`bge-triton bench gateway --repository DIR --model NAME --out reports/gateway`: the
gateway against the SDK straight to Triton, side by side in one run (markdown + CSV).

One local tritonserver (the shipped text endpoint; encoder: `costmodel` = a zero-cost one, so the
hop's overhead is not lost in encoder time; `gpu-costmodel` = the emulated A10G of the other benches,
6.26 ms per batch + 10 us per token; `onnxruntime` = the real model on these CPUs) and one gateway
process in front of it. Two loads, each run for both paths in alternating blocks: one text in flight
(p50 / p99 latency) and saturation (--concurrency single-text callers: throughput). The gateway's
CPU per request is its process's CPU time over the requests it answered.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bge_triton.client import AsyncEmbeddingClient
from bge_triton.loadtest.gateway_harness import bench_main, gateway_process, local_server, texts
from bge_triton.loadtest.report import machine_line, write_csv
from bge_triton.loadtest.stats import percentile

__all__ = ["build_parser", "main"]

Call = Callable[[str], Awaitable[Any]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bge-triton bench gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, required=True, help="an exported model repository")
    p.add_argument("--model", default="bge_large_zh", help="text endpoint NAME in it")
    p.add_argument("--encoder", choices=list(ENCODERS), default="costmodel",
                   help="the encoder behind the text endpoint (costmodel: zero cost, isolates the hops; "
                   "gpu-costmodel: the emulated A10G; onnxruntime: the real model on the CPUs)")
    p.add_argument("--out", type=Path, default=Path("reports/gateway"))
    p.add_argument("--serial", type=int, default=400, help="requests per path, one in flight")
    p.add_argument("--saturated", type=int, default=1200, help="requests per path at saturation")
    p.add_argument("--concurrency", type=int, default=32, help="callers at saturation")
    p.add_argument("--block", type=int, default=50, help="requests per alternating block (one in flight)")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds at saturation (ABBA order)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="extra gateway flag, e.g. --gateway-arg=--no-micro-batch (repeatable)")
    p.add_argument("--name", default=None, help="report file stem (default gateway_bench_<encoder>)")
    return p


ENCODERS: dict[str, dict[str, Any]] = {  # --encoder -> the CpuVariant keywords the local server renders
    "costmodel": {"executor": "costmodel", "cost_a_us": 0.0, "cost_b_us": 0.0},
    "gpu-costmodel": {"executor": "costmodel"},  # the variant's defaults: the A10G fit (loadtest.costmodel)
    "onnxruntime": {},
}


def abba(calls: dict[str, Call], k: int) -> list[tuple[str, Call]]:
    """The paths in turn k: A B, then B A, ... so that a drifting machine favours neither (ABBA order)."""
    order = list(calls.items())
    return order[::-1] if k % 2 else order


async def serial(calls: dict[str, Call], items: list[str], block: int, meter: Callable[[], float] | None = None,
                 cpu: dict[str, float] | None = None) -> dict[str, list[float]]:
    """One request in flight; the paths alternate every `block` requests (ABBA) so drift hits both alike.
    With a meter (the gateway's CPU seconds), cpu[path] sums what it read across that path's own blocks."""
    lat: dict[str, list[float]] = {name: [] for name in calls}
    for k, start in enumerate(range(0, len(items), block)):
        for name, call in abba(calls, k):
            c0 = meter() if meter else 0.0
            for text in items[start:start + block]:
                t0 = time.perf_counter()
                await call(text)
                lat[name].append((time.perf_counter() - t0) * 1e3)
            if meter and cpu is not None:
                cpu[name] = cpu.get(name, 0.0) + meter() - c0
    return lat


async def saturate(call: Call, items: list[str], concurrency: int) -> tuple[float, list[float]]:
    """`concurrency` callers draining `items`; (requests/s, latencies ms)."""
    queue, lat = list(reversed(items)), []

    async def worker() -> None:
        while queue:
            text = queue.pop()
            t0 = time.perf_counter()
            await call(text)
            lat.append((time.perf_counter() - t0) * 1e3)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(items) / (time.perf_counter() - t0), lat


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


SDK, BATCHED, GATEWAY = "sdk -> triton", "sdk + micro-batcher -> triton", "gateway -> triton"


async def measure(args: argparse.Namespace, grpc_url: str, gateway_url: str, gateway: psutil.Process
                  ) -> list[dict[str, Any]]:
    """Both loads; at saturation also the SDK with its own MicroBatcher (the gateway's settings), so the
    gateway's micro-batching is compared with what an SDK user gets from it too, not only with single calls."""
    import aiohttp  # comes with tritonclient[http]; far less client CPU per request than httpx

    url = gateway_url + "/v1/embeddings"
    async with AsyncEmbeddingClient(grpc_url, model=args.model) as sdk, \
            sdk.micro_batcher(max_batch=32, max_wait_s=0.002, max_in_flight=4) as batcher, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency * 2)) as http:
        async def via_gateway(text: str) -> Any:
            async with http.post(url, json={"model": args.model, "input": text, "encoding_format": "base64"}) as r:
                r.raise_for_status()
                return await r.read()

        calls: dict[str, Call] = {SDK: lambda t: sdk.embed_documents([t]), GATEWAY: via_gateway}
        for call in (*calls.values(), batcher.embed):
            await saturate(call, texts(50), 8)
        rows = await _serial_rows(args, calls, gateway)
        return rows + await _saturation_rows(args, {SDK: calls[SDK], BATCHED: batcher.embed, GATEWAY: via_gateway},
                                             gateway)


async def _serial_rows(args: argparse.Namespace, calls: dict[str, Call], gateway: psutil.Process
                       ) -> list[dict[str, Any]]:
    cpu: dict[str, float] = {}  # the gateway's CPU during its own blocks, not while the SDK's run
    lat = await serial(calls, texts(args.serial), args.block, lambda: cpu_s(gateway), cpu)
    serial_cpu = cpu[GATEWAY] / args.serial
    return [{"load": "one in flight", "path": name, "requests": len(values), "p50_ms": percentile(values, 50),
             "p99_ms": percentile(values, 99), "throughput_rps": 1e3 * len(values) / sum(values),
             "gateway_cpu_ms_per_req": serial_cpu * 1e3 if name == GATEWAY else None} for name, values in lat.items()]


async def _saturation_rows(args: argparse.Namespace, calls: dict[str, Call], gateway: psutil.Process
                           ) -> list[dict[str, Any]]:
    sat: dict[str, list[tuple[float, list[float], float]]] = {name: [] for name in calls}
    for k in range(args.rounds):
        for name, call in abba(calls, k):
            c0 = cpu_s(gateway)
            rps, values = await saturate(call, texts(args.saturated), args.concurrency)
            sat[name].append((rps, values, (cpu_s(gateway) - c0) / args.saturated))
    rows = []
    for name, runs in sat.items():
        values = [v for _, vs, _ in runs for v in vs]
        rows.append({"load": f"saturation ({args.concurrency} callers)", "path": name, "requests": len(values),
                     "p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99),
                     "throughput_rps": sum(r for r, _, _ in runs) / len(runs),
                     "gateway_cpu_ms_per_req": (sum(c for _, _, c in runs) / len(runs) * 1e3
                                                if name == GATEWAY else None)})
    return rows


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], command: str, load: str) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["load", "path", "requests", "p50_ms", "p99_ms", "throughput_rps", "gateway_cpu_ms_per_req"]
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    stem = args.name or f"gateway_bench_{args.encoder}"
    write_csv([{k: fmt(r[k]) for k in fields} for r in rows], fields, args.out / f"{stem}.csv", command)
    by = {(r["load"], r["path"]): r for r in rows}
    checks = []
    for load_name in dict.fromkeys(r["load"] for r in rows):
        gw = by[(load_name, GATEWAY)]
        for sdk in (by[key] for key in ((load_name, SDK), (load_name, BATCHED)) if key in by):
            checks.append(f"| {load_name} | {sdk['path']} | {gw['p50_ms'] - sdk['p50_ms']:+.3f} ms | "
                          f"{gw['throughput_rps'] / sdk['throughput_rps']:.3f} | "
                          f"{fmt(gw['gateway_cpu_ms_per_req'])} ms |")
    lines = [f"<!-- generated by `{command}`; rerun it to regenerate -->", "# Gateway vs SDK straight to Triton", "",
             f"- command: `{command}`", f"- machine: {machine_line()}; load average at start {load}; shared with "
             "other jobs (noisy)", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- server: local tritonserver 2.51 (CPU), text endpoint `{args.model}` as shipped, encoder "
             f"`{args.encoder}`", f"- paths: `{SDK}` = AsyncEmbeddingClient (gRPC), one call per text; `{BATCHED}` "
             "(saturation only) = the same client's MicroBatcher with the gateway's settings (32 texts, 2 ms, 4 in "
             f"flight); `{GATEWAY}` = aiohttp POST /v1/embeddings (base64) to the gateway process, which calls "
             "Triton with the same SDK (and its MicroBatcher); the paths take turns in ABBA order",
             f"- gateway flags: {' '.join(args.gateway_arg) or '(defaults: micro-batcher on)'}", "",
             "| load | path | requests | p50 ms | p99 ms | throughput req/s | gateway CPU ms/req |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(fmt(r[k]) for k in fields)} |" for r in rows]
    lines += ["", "Gateway against SDK (issue 15 targets: p50 added <= 0.5 ms, throughput ratio >= 0.90):", "",
              "| load | against | p50 added | throughput ratio | gateway CPU per request |", "|---|---|---|---|---|",
              *checks, ""]
    path = args.out / f"{stem}.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("bge_triton.loadtest.gateway_bench", build_parser(), argv, _run, write_report)


def _run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Start the server and the gateway, measure, stop both (by pid)."""
    from bge_triton.server.cpu_variant import CpuVariant

    with local_server(args.repository, CpuVariant(**ENCODERS[args.encoder]), tmp / "server") as srv, \
            gateway_process(srv.grpc_url, tmp / "gateway.log", model=args.model, repository=args.repository,
                            flags=args.gateway_arg) as (gateway, url):
        return asyncio.run(measure(args, srv.grpc_url, url, psutil.Process(gateway.pid)))

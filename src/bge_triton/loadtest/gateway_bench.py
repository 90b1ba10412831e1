"""`bge-triton bench gateway [sdk|priority|stall] --repository DIR --model NAME`: the OpenAI gateway in front of one
local tritonserver (the shipped text endpoint; --encoder costmodel = the hops alone, gpu-costmodel = an emulated
A10G, onnxruntime = the real model on these CPUs).

sdk: the gateway against the SDK straight to Triton (and its MicroBatcher), one in flight and saturated.
priority: queries one at a time, quiet and under a bulk flood, through the shipped priority levels and one level.
stall: probes while the worst bodies the limits allow go again and again; the gateway's event-loop lag.
--gateway-src DIR runs another checkout's gateway (e.g. a `git worktree` of an older commit) for a before / after.
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bge_triton import flags
from bge_triton.loadtest import harness, loadgen, report
from bge_triton.loadtest.stand import OpenAI, gateway, saturate, texts, turns
from bge_triton.loadtest.stats import percentile, process_tree, summarize
from bge_triton.loadtest.turns import take_turns_async

ENCODERS: dict[str, dict[str, Any]] = {  # --encoder -> the CpuVariant keywords the local server renders
    "costmodel": {"executor": "costmodel", "cost_a_us": 0.0, "cost_b_us": 0.0},
    "gpu-costmodel": {"executor": "costmodel"},  # the variant's defaults: the A10G fit (loadtest.costmodel)
    "onnxruntime": {},
}
SDK, BATCHED, GATEWAY = "sdk -> triton", "sdk + micro-batcher -> triton", "gateway -> triton"
PRIORITY_GATEWAYS = (("queries level 1, passages level 2 (shipped)", ()),
                     ("one level for all (--query-priority 2)", ("--query-priority=2",)))
PROBES: dict[str, dict[str, Any] | None] = {  # the event loop alone, then a one-text query and passage
    "/health": None,
    "small query": {"input": "小文本", "input_type": "query", "encoding_format": "base64"},
    "small passage": {"input": "小文本", "encoding_format": "base64"},
}
INT_FLAGS = {"serial": (400, "sdk: requests per path, one in flight"),  # --flag: (default, help)
             "saturated": (1200, "sdk: requests per path and round at saturation"),
             "concurrency": (32, "sdk: callers at saturation"), "block": (50, "sdk: requests per turn (one in flight)"),
             "rounds": (4, "sdk: rounds at saturation (ABBA order)"),
             "queries": (200, "priority: queries per measurement, one at a time"),
             "flood": (16, "priority: bulk callers sending passages without pause"),
             "flood-batch": (16, "priority: passages per bulk request"),
             "repeats": (2, "stall: at least this many big requests per scenario")}
TARGET_P99_MS = 50.0
LAG_METRIC = "gateway_event_loop_lag_seconds"


def _row(load: str, path: str, lat: list[float], rps: float, cpu_ms: float | None, errors: int = 0) -> dict[str, Any]:
    return {"load": load, "path": path, "requests": len(lat), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "throughput_rps": rps, "gateway_cpu_ms_per_req": cpu_ms, "errors": errors}


async def sdk_scenario(a: argparse.Namespace, grpc_url: str, url: str, pid: int) -> list[dict[str, Any]]:
    """One in flight, then saturation in ABBA rounds; the gateway's CPU (user + system s) over its own turns only."""
    from bge_triton.client import AsyncEmbeddingClient

    def cpu_s() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in process_tree(pid))

    async with AsyncEmbeddingClient(grpc_url, model=a.model) as sdk, OpenAI(url, a.model, a.concurrency * 2) as gw, \
            sdk.micro_batcher(max_batch=32, max_wait_s=0.002, max_in_flight=4) as batcher:
        calls = {SDK: lambda t: sdk.embed_documents([t]), BATCHED: batcher.embed,
                 GATEWAY: lambda t: gw.post({"input": t, "encoding_format": "base64"})}
        for call in calls.values():
            await saturate(call, texts(50, 64), 8)  # warm-up
        lat, cpu = await turns({SDK: calls[SDK], GATEWAY: calls[GATEWAY]}, texts(a.serial, 64), a.block, cpu_s)
        rows = [_row("one in flight", n, v, 1e3 * len(v) / sum(v), cpu[n] / len(v) * 1e3 if n == GATEWAY else None)
                for n, v in lat.items()]
        runs, cpu = await take_turns_async(list(calls), a.rounds, lambda _k, name: saturate(
            calls[name], texts(a.saturated, 64), a.concurrency), cpu_s)  # ABBA rounds; CPU over each path's own
    return rows + [_row(f"saturation ({a.concurrency} callers)", name, [v for r in rs for v in r[1]],
                        sum(r[0] for r in rs) / len(rs),
                        cpu[name] / (len(rs) * a.saturated) * 1e3 if name == GATEWAY else None, sum(r[2] for r in rs))
                   for name, rs in runs.items()]


async def priority_scenario(a: argparse.Namespace, _grpc_url: str, url: str, _pid: int) -> list[dict[str, Any]]:
    """Quiet query latency, then query latency under the bulk flood; passages/s of the flood."""
    async with OpenAI(url, a.model, a.flood * 2 + 4) as gw:
        triton_ms: list[float] = []

        async def query(text: str) -> None:
            triton_ms.append(float((await gw.post({"input": text, "input_type": "query"}))["x-inference-time"]))

        async def bulk(k: int) -> None:
            start = (k * a.flood_batch) % (len(passages) // 2)
            await gw.post({"input": passages[start:start + a.flood_batch]})
            done[0] += a.flood_batch

        await turns({"q": query}, texts(20, 64), 20)  # warm-up
        quiet = (await turns({"q": query}, texts(a.queries, 64), a.queries))[0]["q"]
        stop, done, passages = asyncio.Event(), [0], texts(a.flood_batch * 8, 64) * 2
        flood = asyncio.ensure_future(loadgen.closed_loop(bulk, a.flood, stop.is_set))
        await asyncio.sleep(2.0)  # let the queue fill
        t0, before = time.perf_counter(), done[0]
        del triton_ms[:]
        loaded = (await turns({"q": query}, texts(a.queries, 64), a.queries))[0]["q"]
        rate = (done[0] - before) / (time.perf_counter() - t0)
        stop.set()
        await flood
    return [{"quiet_p50_ms": percentile(quiet, 50), "quiet_p99_ms": percentile(quiet, 99),
             "flood_p50_ms": percentile(loaded, 50), "flood_p99_ms": percentile(loaded, 99),
             "p99_ratio": percentile(loaded, 99) / percentile(quiet, 99),
             "flood_triton_p50_ms": percentile(triton_ms, 50), "flood_passages_per_s": rate}]


def stall_bodies(model: str, chars: int = 1_300_000) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, JSON body): the largest bodies the default limits (8 MiB, 2048 inputs) let through."""
    one, many = "中 " * chars, ["中 " * 1000] * 2048  # 2048 x 4 KB of UTF-8: 8.2 MB of JSON, under 8 MiB
    return [(f"one 5 MB text, truncate {t}", "/v1/embeddings", {"model": model, "input": one, "truncate": t})
            for t in ("START", "NONE", "END")] + [
        ("TEI /embed, one 5 MB text, truncate Left", "/embed",
         {"inputs": one, "truncate": True, "truncation_direction": "Left"}),
        # last: on CPU its texts outlast the text endpoint's queue timeout; the backlog would 503 the next scenario
        ("2048 texts of 2000 chars, truncate START", "/v1/embeddings",
         {"model": model, "input": many, "truncate": "START", "encoding_format": "base64"})]


def lag_buckets(metrics_text: str) -> dict[float, float]:
    """{le: cumulative count} of the gateway's event-loop lag histogram ({} for a gateway without it)."""
    from prometheus_client.parser import text_string_to_metric_families

    return next(({float(s.labels["le"]): s.value for s in f.samples if s.name == LAG_METRIC + "_bucket"}
                 for f in text_string_to_metric_families(metrics_text) if f.name == LAG_METRIC), {})


def summarize_lag(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """The window's 10 ms loop ticks: count, > 2 ms / > 10 ms late, the latest one's bucket (None: not measured)."""
    if not after:
        return dict.fromkeys(("loop_ticks", "late_2ms", "late_10ms", "worst_lag_ms"))
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    total = delta.get(float("inf"), 0.0)
    worst = min((le for le, n in delta.items() if n >= total), default=float("inf")) if total else 0.0
    return {"loop_ticks": int(total), "late_2ms": int(total - delta.get(0.002, 0.0)),
            "late_10ms": int(total - delta.get(0.01, 0.0)),
            "worst_lag_ms": f"<= {worst * 1e3:g}" if worst != float("inf") else "> 5000"}


async def _window(a: argparse.Namespace, url: str, big: tuple[str, bytes] | None) -> list[dict[str, Any]]:
    """A row per probe: probes while the big body goes (--repeats times and --window-s at least), or --window-s."""
    stop, lat, answers = asyncio.Event(), {p: list[float]() for p in PROBES}, list[tuple[str, float]]()
    async with OpenAI(url, a.model) as probes, OpenAI(url, a.model) as bulk:
        async def probe(k: int) -> None:
            name = list(PROBES)[k]
            t0 = time.perf_counter()
            await (probes.get(name) if PROBES[name] is None else probes.post(PROBES[name] or {}))
            lat[name].append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.005)

        lag0, start = lag_buckets(await bulk.get("/metrics")), time.perf_counter()
        task = asyncio.ensure_future(loadgen.closed_loop(probe, len(PROBES), stop.is_set))
        if big is None:
            await asyncio.sleep(a.window_s)
        while big and (len(answers) < a.repeats or time.perf_counter() - start < a.window_s):
            t0, status = time.perf_counter(), "200"
            try:
                await bulk.post(big[1], big[0])
            except Exception as exc:  # an answer all the same: its status is the row's content
                status = str(getattr(exc, "status", type(exc).__name__))
            answers.append((status, time.perf_counter() - t0))
        stop.set()
        await task
        lag = summarize_lag(lag0, lag_buckets(await bulk.get("/metrics")))
    big_s = sum(s for _, s in answers) / len(answers) if answers else None
    return [{"probe": name, "n": s.count, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "max_ms": s.max_ms,
             "big_status": "/".join(sorted({st for st, _ in answers})) or "-", "big_s": big_s, **lag,
             "p99_ok": "yes" if s.p99_ms <= TARGET_P99_MS else "NO", "x": len(answers)}
            for name, s in ((name, summarize(values)) for name, values in lat.items())]


async def stall_scenario(a: argparse.Namespace, _grpc_url: str, url: str, _pid: int) -> list[dict[str, Any]]:
    import orjson

    await _window(argparse.Namespace(**{**vars(a), "window_s": 1.0}), url, None)  # warm-up
    rows = [{"scenario": "no big request", **r} for r in await _window(a, url, None)]
    for name, path, body in stall_bodies(a.model):
        raw = orjson.dumps(body)
        rows += [{"scenario": f"{name} ({len(raw) / 1e6:.1f} MB) x{r['x']}", **r}
                 for r in await _window(a, url, (path, raw))]
    return rows


SCENARIOS: dict[str, tuple[str, list[str], str]] = {  # scenario -> report title, fields, what ran
    "sdk": ("Gateway vs SDK straight to Triton",
            ["load", "path", "requests", "p50_ms", "p99_ms", "throughput_rps", "gateway_cpu_ms_per_req", "errors"],
            f"`{SDK}` = AsyncEmbeddingClient (gRPC), one call per text; `{BATCHED}` (saturation only) = its "
            f"MicroBatcher with the gateway's settings (32 texts, 2 ms, 4 in flight); `{GATEWAY}` = aiohttp POST "
            "/v1/embeddings (base64) to the gateway process (the same SDK and MicroBatcher inside); paths take turns "
            "(ABBA); the gateway's CPU counted over its own turns"),
    "priority": ("Online queries under a bulk indexing flood, with and without Triton priority levels",
                 ["gateway", "quiet_p50_ms", "quiet_p99_ms", "flood_p50_ms", "flood_p99_ms", "p99_ratio",
                  "flood_triton_p50_ms", "flood_passages_per_s"],
                 "queries (input_type=query) one at a time, quiet, then while bulk callers send passage batches "
                 "without pause; per gateway: as shipped, and with --query-priority 2"),
    "stall": ("Gateway stall: probes while the worst bodies are in flight",
              ["scenario", "probe", "n", "p50_ms", "p99_ms", "max_ms", "big_status", "big_s", "loop_ticks",
               "late_2ms", "late_10ms", "worst_lag_ms", "p99_ok"],
              "probes GET /health (the event loop alone), a one-text query and a one-text passage (these also wait "
              "where Triton queues them), each back to back 5 ms apart on its own connection, while the big body goes "
              "again and again on another (xN counts it)"),
}
NOTES = {  # scenario -> what its target says, under the table (sdk: a table of its own)
    "priority": "Target: query p99 under the flood within 2x its quiet p99 (p99_ratio <= 2).",
    "stall": f"Target: probe p99 <= {TARGET_P99_MS:g} ms (p99_ok). Loop columns: the gateway's 10 ms timer "
             "(/metrics gateway_event_loop_lag_seconds) in the window: ticks, ticks > 2 ms / 10 ms late, the latest "
             "tick's bucket; '-' for a gateway without it."}


def _cell(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def write_report(a: argparse.Namespace, rows: list[dict[str, Any]], command: str,
                 machine: dict[str, Any] | None) -> Path:
    """<out>/<name>.md + .csv: the rows as one table (their fields), then what the scenario's targets say."""
    title, fields, what = SCENARIOS[a.scenario]
    stem = a.name or {"sdk": f"gateway_bench_{a.encoder}", "priority": "gateway_priority", "stall": "stall"}[a.scenario]
    report.write_csv(rows, fields, a.out / f"{stem}.csv", command)
    lines = [*report.header(machine),
             f"- what ran: {a.label or 'this checkout'}; gateway flags: {' '.join(a.gateway_arg) or '(defaults)'}",
             f"- server: local tritonserver 2.51 (CPU), text endpoint `{a.model}` as shipped, encoder `{a.encoder}`",
             f"- load: {what}", "",
             *report.table(" | ".join(fields), ([_cell(r.get(k)) for k in fields] for r in rows)), ""]
    if a.scenario != "sdk":
        return report.write_md(a.out / f"{stem}.md", command, title, [*lines, NOTES[a.scenario]])
    by = {(r["load"], r["path"]): r for r in rows}
    checks = [(load_, sdk, f"{by[load_, GATEWAY]['p50_ms'] - by[load_, sdk]['p50_ms']:+.3f} ms",
               f"{by[load_, GATEWAY]['throughput_rps'] / by[load_, sdk]['throughput_rps']:.3f}",
               f"{_cell(by[load_, GATEWAY]['gateway_cpu_ms_per_req'])} ms")
              for load_ in dict.fromkeys(r["load"] for r in rows) for sdk in (SDK, BATCHED) if (load_, sdk) in by]
    return report.write_md(a.out / f"{stem}.md", command, title, [
        *lines, "Gateway against SDK (targets: p50 added <= 0.5 ms, throughput ratio >= 0.90):", "",
        *report.table("load | against | p50 added | throughput ratio | gateway CPU per request", checks)])


def build_parser() -> argparse.ArgumentParser:
    p = flags.parser("bge-triton bench gateway", __doc__ or "")
    p.add_argument("scenario", nargs="?", choices=list(SCENARIOS), default="sdk", help="what to measure (default sdk)")
    p.add_argument("--repository", type=Path, required=True,
                   help="an exported model repository (required, here or in the environment)")
    flags.add_model(p, help="the text endpoint's NAME in --repository")
    p.add_argument("--encoder", choices=list(ENCODERS), help="the encoder behind the text endpoint (default "
                   "costmodel; priority: gpu-costmodel)")
    p.add_argument("--out", type=Path, default=Path("reports/gateway"), help="report directory")
    p.add_argument("--name", help="report file stem (default gateway_bench_<encoder>, gateway_priority, stall)")
    p.add_argument("--label", default="", help="what ran, for the report (e.g. 'before: the last release')")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="extra gateway flag, e.g. --gateway-arg=--no-micro-batch (repeatable; the variable: "
                   "comma-separated)")
    p.add_argument("--gateway-src", type=Path, help="run the gateway from this src/ folder (PYTHONPATH)")
    for flag, (default, what) in INT_FLAGS.items():
        p.add_argument(f"--{flag}", type=int, default=default, help=what)
    p.add_argument("--window-s", type=float, default=5.0, help="stall: seconds of probes per scenario")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from bge_triton.server.cpu_variant import CpuVariant

    args = list(sys.argv[1:] if argv is None else argv)
    a = flags.parse(build_parser(), args)
    a.encoder = a.encoder or ("gpu-costmodel" if a.scenario == "priority" else "costmodel")
    command, machine = shlex.join(["bge-triton", "bench", "gateway", *args]), report.machine_info()
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp, harness.start_server(
            a.repository.resolve(), Path(tmp) / "server", CpuVariant(**ENCODERS[a.encoder]), port_range=None) as srv:
        rows: list[dict[str, Any]] = []
        for label, gateway_flags in PRIORITY_GATEWAYS if a.scenario == "priority" else (("", ()),):
            with gateway(srv.grpc_url, Path(tmp) / f"gateway{len(rows)}.log", a.model, [*gateway_flags, *a.gateway_arg],
                         a.gateway_src) as (url, pid):
                print(f"[bench gateway {a.scenario}] {label} ...", flush=True)
                run = {"sdk": sdk_scenario, "priority": priority_scenario, "stall": stall_scenario}[a.scenario]
                rows += [{"gateway": label, **r} if label else r for r in asyncio.run(run(a, srv.grpc_url, url, pid))]
    print(write_report(a, rows, command, machine).read_text(encoding="utf-8"))
    return 0

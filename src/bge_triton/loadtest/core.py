"""The harness core of the scenarios that start a local server (bench seed, bench shipped, tune, bench probe): one
settings type, the stand-up (export, bench repository, one explicit-control server, the generator's self-check),
the measurement of one load window (client latency, Triton's statistics deltas, CPU) and the side-by-side quiet-hour
turns, and the flag helpers they share. A scenario imports this module, never another scenario."""
from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bge_triton.errors import InputError
from bge_triton.loadtest import loadgen
from bge_triton.loadtest.costmodel import DEFAULT as DEFAULT_COST
from bge_triton.loadtest.costmodel import CostModel
from bge_triton.loadtest.stats import CpuMeter, fetch_stats, stats_delta, summarize
from bge_triton.loadtest.turns import take_turns
from bge_triton.paths import REPORTS_DIR, STATE_DIR

if TYPE_CHECKING:  # the local stand-up needs the server extra; a --url scenario imports this module without it
    from bge_triton.loadtest import harness

SCENARIO_ORDER = ("no_batching", "static_32", "dynamic_5ms", "delay_0", "text_endpoint")
EXECUTORS = ("onnxruntime", "costmodel")


@dataclass(frozen=True)
class BenchSettings:
    """Everything one run of the harness needs (bench seed, bench shipped, tune); built once from flags."""

    out: Path = REPORTS_DIR / "bench"
    executors: tuple[str, ...] = EXECUTORS
    scenarios: tuple[str, ...] = SCENARIO_ORDER
    real_repo: Path = STATE_DIR / "loadtest" / "real_repo"
    real_model: str = "synthetic:bge-small-zh"
    real_name: str = "bge_small_zh"
    seq_len: int = 64  # emulated rows (the seed's length)
    concurrency: int = 64
    real_seq_len: int = 16  # real rows on CPU: shorter texts so a window holds several batches
    real_concurrency: int = 32  # enough to fill static batch 32
    low_fraction: float = 0.2
    warmup_s: float = 2.0
    duration_s: float = 10.0
    low_duration_s: float = 15.0
    processes: int = 1
    intra_op_threads: int = 0
    max_chars: int = 256
    cost: CostModel = DEFAULT_COST
    state_dir: Path = STATE_DIR / "loadtest" / "bench_state"
    command: str = "bge-triton bench seed"
    # Emulated rows only: instance counts / text-endpoint parameters other than the configs' (None = the config's)
    encoder_instances: int | None = None
    text_instances: int | None = None
    text_params: dict[str, str] = field(default_factory=dict)
    cpu_lock: bool = True  # real rows: False = one instance per ONNX Runtime model, no shared CPU lock


@dataclass
class BenchRun:
    """Rows plus what the report prints about the run."""

    settings: BenchSettings
    rows: list[dict] = field(default_factory=list)
    selfcheck_rps: float = 0.0
    machine: dict = field(default_factory=dict)


def ensure_real_repo(s: BenchSettings) -> None:
    """Export the real-model rows' model once (cached under .kit) if it is not there."""
    from bge_triton.loadtest import harness

    harness.export(s.real_model, s.real_repo, s.real_name, "fp32", "--max-length", "256")


@contextlib.contextmanager
def stand(s: BenchSettings, name: str, real: bool, users: int, ramp_s: float = 0.0) -> Iterator[harness.Harness]:
    """THE stand-up of bench, shipped and tune: the bench repository (state_dir/../name; the real export when
    `real`), one explicit-control server, the load generator's self-check at `users` (h.self_check_result)."""
    from bge_triton.loadtest import harness

    if real:
        ensure_real_repo(s)
    repo = harness.build_repository(s.state_dir.parent / name, s.real_repo if real else None, s.real_name, s.command)
    h = harness.Harness(repo, s.state_dir, s.cost, s.intra_op_threads, cpu_lock=s.cpu_lock).start()
    try:
        rps = h.self_check(users, max(2.0, s.duration_s / 2), s.processes, ramp_s=ramp_s)
        print(f"load-generator self-check: {rps:.0f} req/s against the no-op model at C={users}, "
              f"{h.self_check_result.late if h.self_check_result else 0} unanswered", flush=True)
        yield h
    finally:
        h.stop()


Probe = Callable[[], dict[int, float]]  # CPU seconds so far per pid of processes to count (e.g. some stubs)


def _window(h: harness.Harness, spec: loadgen.LoadSpec, watch: list[str] | tuple[str, ...],
            probe: Probe | None) -> tuple[loadgen.LoadResult, dict, tuple[float, float, float], float, float]:
    """One load run: (result, the change of Triton's counters per watched model, CPU (machine %, server cores,
    generator cores), wall seconds, probe CPU seconds)."""
    before = {m: fetch_stats(h.live.http_url, m) for m in watch}
    p0 = probe() if probe else {}
    meter = CpuMeter(h.live.pid)
    meter.start()
    t0 = time.monotonic()
    res = loadgen.run(spec)
    cpu, wall = meter.stop(), time.monotonic() - t0
    p1 = probe() if probe else {}
    counts = {m: {k: v - before[m].get(k, 0.0) for k, v in fetch_stats(h.live.http_url, m).items()} for m in watch}
    return res, counts, cpu, wall, sum(v - p0.get(pid, 0.0) for pid, v in p1.items())


def measure(h: harness.Harness, s: BenchSettings, model: str, watch: list[str], bodies: tuple[bytes, ...],
            mode: str, rate: float = 0.0, users: int = 64, ramp_s: float = 0.0, probe: Probe | None = None) -> dict:
    """One load run: client latency + Triton stats deltas of `watch` models + CPU use (ramp_s: closed users' start;
    probe: the row's probe_cores)."""
    spec = loadgen.LoadSpec(*h.host_port, model, bodies, mode, concurrency=users if mode == "closed" else 512,
                            rate=rate, warmup_s=s.warmup_s, duration_s=s.duration_s if mode == "closed" else
                            s.low_duration_s, processes=s.processes, ramp_s=ramp_s)
    res, counts, cpu, wall, probed = _window(h, spec, watch, probe)
    row = _row(mode, users, rate, res, counts, cpu)
    return {**row, "probe_cores": probed / wall} if probe else row


def _row(mode: str, users: int, rate: float, res: loadgen.LoadResult, counts: dict, cpu: tuple) -> dict:
    """The row of one measurement: what the client saw (res), what Triton counted per watched model (the called
    model first: its queue; the encoder last: batch and compute) and the CPU (machine %, server, generator cores)."""
    lat = summarize(res.latencies_ms)
    enc, front = (stats_delta({}, counts[m]) for m in (list(counts)[-1], list(counts)[0]))
    return {"phase": "peak" if mode == "closed" else "low",
            "load": f"C={users}" if mode == "closed" else f"{rate:.0f}/s",
            "throughput": res.throughput, "avg_ms": lat.avg_ms, "p50_ms": lat.p50_ms, "p99_ms": lat.p99_ms,
            "n": lat.count, "errors": res.errors + res.late, "unanswered": res.late,
            "first_error": res.first_error[:120], "avg_batch": enc.avg_batch, "front_batch": front.avg_batch,
            "queue_ms": front.queue_ms, "compute_ms": enc.compute_ms, "cpu_pct": cpu[0], "server_cores": cpu[1],
            "gen_cores": cpu[2], "window_start": res.window_start, "loop_lag_ms": res.loop_lag_ms,
            "loop_lag_max_ms": res.loop_lag_max_ms}


@dataclass(frozen=True)
class Leg:
    """One path of a side-by-side quiet-hour measurement: the called model, the watched ones (it first, the encoder
    last), the request bodies."""

    model: str
    watch: tuple[str, ...]
    bodies: tuple[bytes, ...]


def measure_side_by_side(h: harness.Harness, s: BenchSettings, legs: list[Leg], rate: float, block_s: float = 2.0,
                         probe: Probe | None = None) -> list[dict]:
    """Quiet hours for several paths in ONE window: each leg's open loop at `rate` (alone on the server) in turns
    of block_s seconds (after a 0.25 s warm-up), ABBA order (turns.take_turns), until each has had s.low_duration_s;
    a row per leg, its turns summed.
    A shared machine drifts over minutes (the shipped bench's quiet-hour gap: +0.7 .. +2.3 ms over ten sequential runs):
    taking turns puts the drift on both."""
    rounds = max(1, round(s.low_duration_s / block_s))

    def window(k: int, i: int) -> tuple[loadgen.LoadResult, dict, tuple[float, float, float], float, float]:
        spec = loadgen.LoadSpec(*h.host_port, legs[i].model, legs[i].bodies, "open", concurrency=512, rate=rate,
                                warmup_s=min(0.25, s.warmup_s), duration_s=block_s, seed=1000 * k + i)
        return _window(h, spec, legs[i].watch, probe)

    rows = []
    for i, windows in take_turns(list(range(len(legs))), rounds, window)[0].items():
        counts: dict[str, dict[str, float]] = {m: {} for m in legs[i].watch}
        res, cpu, wall, probed = loadgen.LoadResult(), [0.0] * 3, 0.0, 0.0
        for r, c, load, w, p in windows:  # the leg's turns, summed
            for m, delta in c.items():
                counts[m] = {k: counts[m].get(k, 0.0) + v for k, v in delta.items()}
            res.merge(r)
            res.window_start = res.window_start or r.window_start
            wall, probed, cpu = wall + w, probed + p, [acc + v * w for acc, v in zip(cpu, load, strict=True)]
        res.window_s, wall = rounds * block_s, max(wall, 1e-9)
        rows.append({**_row("open", 0, rate, res, counts, tuple(v / wall for v in cpu)), "probe_cores": probed / wall,
                     "window_s": rounds * block_s, "turns": rounds, "turn_s": block_s})
    return rows


def add_flags(p: argparse.ArgumentParser, *rows: tuple) -> None:
    """A flag per (name, default, help[, type]) row: a False default is a switch; the type: the default's, else int."""
    for name, default, what, *kind in rows:
        if default is False:
            p.add_argument(f"--{name}", action="store_true", help=what)
        else:
            p.add_argument(f"--{name}", default=default, help=what,
                           type=kind[0] if kind else int if default is None else type(default))


def add_common_flags(p: argparse.ArgumentParser, d: BenchSettings) -> None:
    """The flags every scenario of the harness shares (bench seed, bench shipped, tune), their defaults from d."""
    add_flags(p, ("out", d.out, f"report directory (default {d.out})"),
              ("real-repo", d.real_repo, "exported repository (real rows, tokenizer)"),
              ("real-name", d.real_name, "model name in --real-repo"),
              ("state-dir", d.state_dir, "server state directory"),
              ("cost-a-us", d.cost.a_us, "cost model a (default: seed fit)"),
              ("cost-b-us", d.cost.b_us, "cost model b per token"))


def from_flags(a: argparse.Namespace, d: Any, command: str, **fields: Any) -> Any:
    """d (a BenchSettings) with the common flags' values (the cost model is the seed fit unless --cost-a-us /
    --cost-b-us name another), the command line and `fields`."""
    same = (a.cost_a_us, a.cost_b_us) == (DEFAULT_COST.a_us, DEFAULT_COST.b_us)
    return replace(d, out=a.out, real_repo=a.real_repo, real_name=a.real_name, state_dir=a.state_dir,
                   cost=DEFAULT_COST if same else CostModel(a.cost_a_us, a.cost_b_us, source="--cost-a-us/--cost-b-us"),
                   command=command.strip(), **fields)


def preferred_sets(text: str) -> tuple[tuple[int, ...], ...]:
    """'none;16,32;32' -> ((), (16, 32), (32,))."""
    try:
        return tuple(() if part.strip() in ("", "none") else tuple(int(v) for v in part.split(","))
                     for part in text.split(";"))
    except ValueError as exc:
        raise InputError(f"--preferred {text!r}: expected ';'-separated comma lists, e.g. 'none;16,32;32'") from exc

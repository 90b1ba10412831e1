"""The targets of the shipped config pair as pure functions (verdicts, the pick, the ideal rate, host sizing,
the planner's and the scheduler's estimates): `bench shipped` measures, these judge, unit-tested without a server."""
from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bge_triton.loadtest.costmodel import CostModel


@functools.cache
def endpoint() -> tuple[Any, Any, Any, Any]:
    """The committed text endpoint: its settings and its text_stages, text_scheduler and text_core modules, loaded by
    the names the python backend stub imports them by (the planner and policy the estimates below price)."""
    from bge_triton.repository import TEXT_MODEL_DIR, endpoint_modules, load_config, text_settings

    core, stages, scheduler = endpoint_modules()
    return text_settings(load_config(TEXT_MODEL_DIR.parent)), stages, scheduler, core


@dataclass(frozen=True)
class Targets:
    """The thresholds the committed configs, measured as shipped, must meet (`bge-triton bench shipped`)."""

    p50_vs_direct_ms: float = 1.5  # quiet hours: text p50 - direct-encoder p50 (delay 0, same tokens)
    p50_vs_model_ms: float = 4.5  # quiet hours: text p50 - t(1, median L)
    p99_vs_direct_ms: float = 3.0  # quiet hours: text p99 - direct-encoder p99
    vs_tensor: float = 0.90  # peak: text texts/s over the tensor path's texts/s (same traffic)
    vs_ideal: float = 0.85  # peak: text texts/s over the cost model's ideal at max batch


def ideal_rate(cost: CostModel, max_batch: int, mean_tokens: float) -> float:
    """Texts/s of one emulated GPU running only full batches of the traffic's mean length (no padding)."""
    return max_batch * 1000.0 / cost.batch_ms(max_batch, mean_tokens)


def saturation(peaks: list[dict]) -> dict:
    """The peak as saturation: the row with the highest texts/s of one path's concurrency sweep (nan counts as 0)."""
    if not peaks:
        raise ValueError("no peak rows: the concurrency sweep measured nothing (--peak-concurrency)")
    return max(peaks, key=lambda r: r["throughput"] if r["throughput"] == r["throughput"] else 0.0)


def verdicts(text_low: dict, text_peaks: list[dict], direct_low: dict, tensor_peaks: list[dict], t1_ms: float,
             ideal: float, t: Targets = Targets()) -> list[dict]:
    """One row per target: what, the limit, the measured value, pass, and where the peak was taken (`at`). The peak
    targets compare each path's saturation (its sweep's highest texts/s): a closed loop of C users caps batching."""
    text, tensor = saturation(text_peaks), saturation(tensor_peaks)
    ratio = lambda a, b: a / b if b else math.nan  # noqa: E731
    at = f"text {text.get('load', '?')}"
    return [{"target": name, "limit": lim, "measured": v, "sense": ">=" if higher else "<=", "at": where,
             "pass": not math.isnan(v) and (v >= lim if higher else v <= lim)} for name, v, lim, higher, where in (
        ("quiet p50 - direct encoder p50 (ms)", text_low["p50_ms"] - direct_low["p50_ms"], t.p50_vs_direct_ms, False,
         ""),
        ("quiet p50 - t(1, median L) (ms)", text_low["p50_ms"] - t1_ms, t.p50_vs_model_ms, False, ""),
        ("quiet p99 - direct encoder p99 (ms)", text_low["p99_ms"] - direct_low["p99_ms"], t.p99_vs_direct_ms, False,
         ""),
        ("peak texts/s / tensor path texts/s", ratio(text["throughput"], tensor["throughput"]), t.vs_tensor, True,
         f"{at}, tensor {tensor.get('load', '?')}"),
        ("peak texts/s / ideal at max batch", ratio(text["throughput"], ideal), t.vs_ideal, True, at))]


def queue_check(concurrency: int, max_queue_size: int, timeout_us: int, texts_per_s: float) -> str:
    """Whether a queue policy rejects a closed loop of C users: '' = it holds them, else why not, in Triton's words.
    All C can sit in the queue at once (C > max_queue_size, 0 = unlimited, can reject) and a request waits about
    C / texts_per_s (Little), so a longer wait than the timeout (0 = none) expires."""
    why = []
    if 0 < max_queue_size < concurrency:
        why.append(f"C={concurrency} > max_queue_size {max_queue_size}: 'Exceeds maximum queue size'")
    wait_s = concurrency / texts_per_s if texts_per_s > 0 else math.inf
    if timeout_us > 0 and wait_s > timeout_us / 1e6:
        why.append(f"wait ~C / rate = {wait_s:.1f} s > timeout {timeout_us / 1e6:g} s: 'Request timeout expired'")
    return "; ".join(why)


def pick(candidates: list[tuple[str, list[dict]]]) -> str | None:
    """The candidate passing the most targets; ties go to the earlier one (list the preferred first)."""
    best = max(enumerate(candidates), key=lambda ic: (sum(v["pass"] for v in ic[1][1]), -ic[0]), default=None)
    return best[1][0] if best else None


def cpu_s_per_1000(cores_busy: float, texts_per_s: float) -> float:
    """CPU-seconds per 1000 texts from cores busy over a window and the window's texts/s."""
    return 1000.0 * cores_busy / texts_per_s if texts_per_s > 0 else math.nan


def instances_for_host(gpu_texts_per_s: float, texts_per_s_per_instance: float, host_cores: int = 16,
                       reserved_cores: int = 4, floor: int = 2) -> int:
    """Text-endpoint instances that feed `gpu_texts_per_s` (ceil), at most the cores left to them (reserved: Triton's
    front ends, batcher threads, the encoder's host work), at least `floor` (2: one tokenizes while one encodes)."""
    if texts_per_s_per_instance <= 0:
        raise ValueError(f"texts_per_s_per_instance={texts_per_s_per_instance}: must be > 0 (measure it first)")
    return max(floor, min(math.ceil(gpu_texts_per_s / texts_per_s_per_instance), host_cores - reserved_cores))


def planned_rate(lengths: list[int], batch: int, cost: CostModel, plan: Callable, budget: int = 8192,
                 max_batch: int = 64, multiple: int = 8, overhead_tokens: int = 628, samples: int = 50) -> float:
    """Texts/s of the emulated GPU when text batches of `batch` texts (drawn from `lengths`, seeded) are split by
    `plan` (text_stages.plan_sub_batches): the ceiling the traffic's padding and per-call cost leave."""
    rng, ms = random.Random(0), 0.0
    for _ in range(samples):
        runs = plan([rng.choice(lengths) for _ in range(batch)], budget, max_batch, multiple, overhead_tokens)
        ms += sum(cost.batch_ms(len(rows), pad) for rows, pad in runs)
    return 1000.0 * batch * samples / ms


@dataclass
class _Item:  # what choose() reads of a pooled text
    padded: int
    arrival: float


def closed_loop_rate(lengths: Sequence[int], users: int, cost: CostModel, choose: Callable, *, instances: int = 1,
                     budget: int = 8192, max_batch: int = 64, multiple: int = 8, overhead_tokens: int = 628,
                     texts: int = 20000, seed: int = 0) -> float:
    """What the scheduler reaches on a length mix: `users` one-text callers, each sending its next text (drawn from
    `lengths`, seeded) when the last returns, over `instances` pools; the emulated GPU runs one sub-batch at a time,
    chosen by the shipped policy (text_scheduler.choose) from one pool. Texts/s in steady state (after `users`)."""
    if users < 1 or instances < 1:
        raise ValueError(f"users={users}, instances={instances}: both must be >= 1")
    rng = random.Random(seed)
    pad = lambda n: -(-n // multiple) * multiple  # noqa: E731
    pools: list[list[_Item]] = [[] for _ in range(instances)]
    for u in range(users):
        pools[u % instances].append(_Item(pad(rng.choice(lengths)), 0.0))
    now_ms = counted_ms = 0.0
    done = counted = turn = 0
    while counted < texts:
        k, turn = turn % instances, turn + 1
        if not pools[k]:
            continue
        run = choose(pools[k], budget, max_batch, overhead_tokens)
        taken = set(map(id, run))
        pools[k] = [it for it in pools[k] if id(it) not in taken]
        ms = cost.batch_ms(len(run), max(it.padded for it in run))
        now_ms += ms
        done += len(run)
        if done > users:  # past the start: every user has been answered once
            counted_ms += ms
            counted += len(run)
        for _ in run:  # each answered user sends its next text to a random instance
            pools[rng.randrange(instances)].append(_Item(pad(rng.choice(lengths)), now_ms / 1000.0))
    return 1000.0 * counted / counted_ms

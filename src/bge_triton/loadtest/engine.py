"""The harness core's load engine against a Target: one set of texts for every path (the text endpoint gets the
texts, the encoder gets the same texts tokenized and padded to one length: Triton batches equal shapes only), and
closed, open (steady) or shaped (Locust's tidal curve, shapes.level) load from the kit's one load engine
(loops.drive) through tritonclient's asyncio clients, with Triton's batch statistics and utilisation gauges over the
same window (one `Point` per offered load)."""
from __future__ import annotations

import asyncio
import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bge_triton.errors import InputError
from bge_triton.loadtest import corpus
from bge_triton.loadtest.loops import Load, drive
from bge_triton.loadtest.stats import summarize
from bge_triton.loadtest.target import Target, batch_counts, counts_delta


@dataclass(frozen=True)
class Texts:
    """The load's texts and their token rows, one length for all (`seq_len`, the padded tensor shape)."""

    texts: tuple[str, ...]
    ids: np.ndarray  # int64 [n, seq_len]
    mask: np.ndarray

    @property
    def seq_len(self) -> int:
        return int(self.ids.shape[1])


def load_texts(tokenizer: str | Path, seq_len: int, n: int = 256, seed: int = 1) -> Texts:
    """n reviews whose tokens (special ones included) fit `seq_len`, padded to it: the same texts for both paths."""
    from bge_triton.client.tokens import load_tokenizer

    if not Path(tokenizer).exists():
        raise InputError(f"--tokenizer {tokenizer}: not found; give the text endpoint's tokenizer directory (the "
                         "export wrote it to MODEL_REPOSITORY/<model>/1/tokenizer), so the tensor rows are the "
                         "same texts the text endpoint gets")
    tok, _ = load_tokenizer(str(tokenizer))
    tok.no_padding()
    tok.no_truncation()
    pool = list(corpus.load("reviews"))
    random.Random(seed).shuffle(pool)
    texts, rows = [], []
    for text in pool:
        ids = tok.encode(text).ids
        if len(ids) <= seq_len:
            texts.append(text)
            rows.append(ids)
            if len(texts) == n:
                break
    if not texts:
        raise InputError(f"no review fits --seq-len {seq_len} tokens; raise it")
    ids = np.zeros((len(rows), seq_len), np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return Texts(tuple(texts), ids, mask)


def _inputs(target: Target, model_inputs: Sequence[str], texts: Texts, text_mode: bool, i: int) -> list[Any]:
    """One request's inputs: text BYTES [1, 1], or the encoder's int64 [1, seq_len] rows by the served names."""
    if target.url.protocol == "grpc":
        import tritonclient.grpc.aio as tc
    else:
        import tritonclient.http.aio as tc
    k = i % len(texts.texts)
    if text_mode:
        inp = tc.InferInput(model_inputs[0], [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[texts.texts[k].encode()]], dtype=np.object_))
        return [inp]
    out = []
    for name in model_inputs:
        row = texts.mask[k:k + 1] if name == "attention_mask" else (
            np.zeros_like(texts.ids[k:k + 1]) if name == "token_type_ids" else texts.ids[k:k + 1])
        inp = tc.InferInput(name, list(row.shape), "INT64")
        inp.set_data_from_numpy(row)
        out.append(inp)
    return out


@dataclass
class Point:
    """What one window measured: the client's view, Triton's batches and its utilisation gauges."""

    load: Load
    sent: int = 0
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    window_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    batches: dict[int, int] = field(default_factory=dict)  # the encoder's {batch size: executions}
    front_batches: dict[int, int] = field(default_factory=dict)  # the called model's, when it is not the encoder
    utilisation: dict[str, float] = field(default_factory=dict)  # mean over the window: gpu / cpu (0..1)

    def row(self) -> dict[str, Any]:
        lat = summarize(self.latencies_ms)
        total = sum(self.batches.values())
        return {"load": self.load.label, "users": self.load.users, "rate": self.load.rate, "sent": self.sent,
                "throughput": self.ok / self.window_s if self.window_s else 0.0, "avg_ms": lat.avg_ms,
                "p50_ms": lat.p50_ms, "p99_ms": lat.p99_ms, "n": lat.count, "errors": self.errors,
                "first_error": self.first_error[:160],
                "avg_batch": sum(k * v for k, v in self.batches.items()) / total if total else math.nan,
                "gpu_util": self.utilisation.get("gpu", math.nan), "cpu_util": self.utilisation.get("cpu", math.nan)}


class _Gauges(threading.Thread):
    """Samples the target's utilisation gauges every `every_s` seconds until stopped; the mean per gauge."""

    def __init__(self, target: Target, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.target, self.every_s, self.halt = target, every_s, threading.Event()
        self.samples: list[dict[str, float]] = []

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            if got := self.target.utilisation():
                self.samples.append(got)

    def stop(self) -> dict[str, float]:
        self.halt.set()
        self.join(timeout=5)
        keys = {k for s in self.samples for k in s}
        return {k: float(np.mean([s[k] for s in self.samples if k in s])) for k in keys}


async def _drive(target: Target, model: str, inputs: Callable[[int], list[Any]], load: Load, warmup_s: float,
                 duration_s: float, point: Point, side: Callable[[], Any] | None = None) -> None:
    """The load itself: warm-up, then the window; each answer or error of a request SENT in the window counts.
    `side`: a blocking call (a reload) run in a thread while the load runs; the load lasts until it returns."""
    if target.url.protocol == "grpc":
        import tritonclient.grpc.aio as tc
    else:
        import tritonclient.http.aio as tc
    client = tc.InferenceServerClient(target.url.address)
    loop = asyncio.get_running_loop()
    begin = loop.time() + warmup_s
    end = begin + duration_s
    side_task = asyncio.ensure_future(asyncio.to_thread(side)) if side else None
    stopped: list[float] = []  # when sending stopped: the window's end

    def end_of_window() -> float:
        return min(stopped, default=math.inf)

    def over(now: float) -> bool:
        if now >= end and (side_task is None or side_task.done()):
            stopped.append(now)
            return True
        return False

    def count(sched: float, done: float, kind: str, error: BaseException | None) -> None:
        # open loop: the requests SCHEDULED in the window count (none is left out for being slow); closed loop: those
        # COMPLETED in it (its users stop sending at the end; the last answers of a slow server fall outside)
        if (sched if not load.users else done) < begin or (load.users and done > end_of_window()):
            return
        point.sent += 1
        if kind != "ok":
            point.errors += 1
            point.first_error = point.first_error or f"{kind}: {error}"
        else:
            point.ok += 1
            point.latencies_ms.append((done - sched) * 1e3)

    async def infer(i: int) -> None:
        await client.infer(model, inputs(i))

    try:  # the kit's one load engine (loops.drive), until the window and the side are over
        await drive(infer, load, loop.time, begin, end, count, until=over)
        if side_task is not None:
            await side_task
    finally:
        await client.close()
    point.window_s = max(min(stopped, default=end), end) - begin


def measure(target: Target, model: str, model_inputs: Sequence[str], texts: Texts, load: Load, warmup_s: float,
            duration_s: float, side: Callable[[], Any] | None = None) -> Point:
    """One window of `load` on `model` (the text endpoint when its only input is BYTES `text`, else tensors), with
    the encoder's batches (Triton's batch_stats delta) and the utilisation gauges averaged over the window."""
    text_mode = model == target.model
    point = Point(load)
    watch = [target.encoder] + ([model] if model != target.encoder else [])
    before = [batch_counts(target.stats(m)) for m in watch]
    gauges = _Gauges(target)
    gauges.start()
    try:
        asyncio.run(_drive(target, model, lambda i: _inputs(target, model_inputs, texts, text_mode, i), load,
                           warmup_s, duration_s, point, side))
    finally:
        point.utilisation = gauges.stop()
    point.batches, *front = (counts_delta(b, batch_counts(target.stats(m))) for b, m in zip(before, watch, strict=True))
    point.front_batches = front[0] if front else {}
    return point

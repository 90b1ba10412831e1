"""Raw ONNX Runtime side of the stack benchmark: the same ONNX file and tokenizer, in-process, no server.

Texts are tokenized with the text endpoint's own tokenizer.json (truncated to max_length), sorted by
length over the WHOLE text set (stricter than the stack, which sorts only inside one Triton batch),
cut into batches of B and padded to a multiple of 8, exactly as the endpoint pads. Timing covers
session.run only (tokenization excluded), so the raw side is the most favourable reference.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def tokenize(tokenizer_json: Path, texts: list[str], max_length: int = 512) -> list[list[int]]:
    """Token ids per text, as the text endpoint computes them (truncation on, no padding)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_padding()
    tok.enable_truncation(max_length)
    return [enc.ids for enc in tok.encode_batch(texts)]


def pad_rows(rows: list[list[int]], multiple: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask [B, L], L = longest row rounded up to `multiple`."""
    width = -(-max(len(r) for r in rows) // multiple) * multiple  # the endpoint's pad_to_multiple
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for k, row in enumerate(rows):
        ids[k, :len(row)] = row
        mask[k, :len(row)] = 1
    return ids, mask


def sorted_batches(ids: list[list[int]], batch: int, multiple: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The whole set sorted by length, cut into batches of `batch`, each padded to its longest."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    return [pad_rows([ids[i] for i in order[k:k + batch]], multiple) for k in range(0, len(order), batch)]


def fifo_padding_ratio(lengths: list[int], batch: float) -> float:
    """Padded / real tokens of FIFO batches (arrival order, pad to the batch's longest, no sorting)."""
    size = max(1, int(round(batch))) if batch == batch else 1  # nan (no batches seen) -> 1
    padded = sum(max(lengths[k:k + size]) * len(lengths[k:k + size]) for k in range(0, len(lengths), size))
    return padded / max(1, sum(lengths))


@dataclass(frozen=True)
class RawConfig:
    """One raw ONNX Runtime configuration: threads, spin-waiting, batch size, batch order.

    order "sorted" runs the length-sorted batches shortest first (a batch job holding the whole set:
    consecutive runs mostly repeat a shape, which ONNX Runtime runs faster); "shuffled" runs them in a
    seeded random order (traffic). The sweep tries both and (a) keeps the faster.
    """

    threads: int
    spinning: bool
    batch: int
    order: str = "shuffled"

    @property
    def label(self) -> str:
        return f"B={self.batch}, {self.threads} threads, spin {'on' if self.spinning else 'off'}, {self.order}"


class RawEncoder:
    """ONNX Runtime sessions on the repository's model.onnx, one per spin setting (same threads)."""

    def __init__(self, onnx_path: Path, threads: int):
        import onnxruntime as ort

        self.threads = threads
        self.sessions = {}
        for spinning in (True, False):
            opts = ort.SessionOptions()
            if threads > 0:
                opts.intra_op_num_threads = threads
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
            if spinning:  # as the kit's sessions: spin inside a run, stop when it returns
                opts.add_session_config_entry("session.force_spinning_stop", "1")
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self.sessions[spinning] = ort.InferenceSession(str(onnx_path), opts,
                                                           providers=["CPUExecutionProvider"])
        self.input_names = {i.name for i in self.sessions[True].get_inputs()}

    def run(self, spinning: bool, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        feeds = {k: v for k, v in (("input_ids", ids), ("attention_mask", mask)) if k in self.input_names}
        return self.sessions[spinning].run(["embedding"], feeds)[0]

    def throughput(self, cfg: RawConfig, batches: list[tuple[np.ndarray, np.ndarray]], window_s: float,
                   seed: int = 0) -> float:
        """Texts/s over whole passes of `batches` (in cfg.order) lasting at least window_s."""
        order = list(range(len(batches)))
        if cfg.order == "shuffled":
            random.Random(seed).shuffle(order)
        self.run(cfg.spinning, *batches[order[0]])  # warm this shape
        texts, start = 0, time.perf_counter()
        while True:
            for b in order:
                ids, mask = batches[b]
                self.run(cfg.spinning, ids, mask)
                texts += ids.shape[0]
            elapsed = time.perf_counter() - start
            if elapsed >= window_s:
                return texts / elapsed

    def latency_ms(self, spinning: bool, row: list[int], multiple: int) -> float:
        """Batch-1 latency of one text (pad + session.run), milliseconds."""
        start = time.perf_counter()
        self.run(spinning, *pad_rows([row], multiple))
        return (time.perf_counter() - start) * 1e3

"""The text endpoint's stages on one Triton batch: decode -> tokenize -> plan -> run -> scatter.

Pure (numpy and tokenizers only, no Triton): model.py feeds it each request's raw `text` array and
parameters and turns what comes back into responses. encode_pre / encode_core / encode_post follow
Infinity's split of an embedding model (tokenize / forward / per-request output).
"""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from tokenizers import Tokenizer

from text_core import BadInput, EncoderBackend, TextError, TextSettings, TooLong, truthy

__all__ = ["decode", "Tokenizers", "plan_sub_batches", "pad", "Batch", "TextPipeline"]


def decode(raw: np.ndarray, parameters: str | None = None) -> tuple[list[str], bool]:
    """One request's texts and its `truncate` flag (default true); BadInput names the bad text."""
    params = json.loads(parameters or "{}")
    truncate = truthy(params.get("truncate", True))
    texts = []
    for j, item in enumerate(np.asarray(raw, dtype=object).reshape(-1)):
        if isinstance(item, str):
            text = item
        else:
            try:
                text = bytes(item).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadInput(f"text {j} is not valid UTF-8 ({exc.reason} at byte {exc.start}): "
                               "send UTF-8 encoded text") from None
        if "\x00" in text:
            raise BadInput(f"text {j} contains a NUL byte: remove control characters")
        if not text.strip():
            raise BadInput(f"text {j} is empty or whitespace only: send at least one visible character")
        texts.append(text)
    return texts, truncate


class Tokenizers:
    """The model's tokenizer twice: truncating at max_length, and untruncated for exact counts."""

    def __init__(self, tokenizer: Tokenizer, max_length: int) -> None:
        self.max_length = max_length
        self.trunc = tokenizer
        self.trunc.no_padding()
        self.trunc.enable_truncation(max_length)
        self.full = Tokenizer.from_str(tokenizer.to_str())
        self.full.no_truncation()
        self.pad_id = self.full.token_to_id("[PAD]") or 0

    @classmethod
    def from_dir(cls, directory: str, max_length: int) -> "Tokenizers":
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: run `python -m bge_triton.export --repository <repo> "
                                    "--name <name>`")
        return cls(Tokenizer.from_file(path), max_length)

    def encode(self, texts: list[str], truncate: bool) -> list[list[int]]:
        """Token ids of `texts` in ONE call (a lone text skips encode_batch's thread-pool hand-off)."""
        tok = self.trunc if truncate else self.full
        if len(texts) == 1:
            return [tok.encode(texts[0]).ids]
        return [enc.ids for enc in tok.encode_batch(texts)] if texts else []


def plan_sub_batches(lengths: Sequence[int], budget: int, max_batch: int, multiple: int,
                     overhead_tokens: int = 64) -> list[tuple[list[int], int]]:
    """Length-aware split of one Triton batch into encoder sub-batches, optimal by DP.

    Texts sorted by length; contiguous runs become sub-batches padded to the run's longest (rounded up
    to `multiple`). Cost of a run = B x padded_L + overhead_tokens; constraints B <= max_batch and
    B x padded_L <= budget (a lone text longer than the budget still gets its own run).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    pads = [-(-lengths[i] // multiple) * multiple for i in order]
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: cheapest split of the j shortest texts
        pad_len = pads[j - 1]
        for i in range(j - 1, -1, -1):  # run = order[i:j], padded to pads[j-1]
            size = j - i
            if size > max_batch or (size > 1 and size * pad_len > budget):
                break
            cost = best[i] + size * pad_len + overhead_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    plans, j = [], n
    while j > 0:
        i = cut[j]
        plans.append((order[i:j], pads[j - 1]))
        j = i
    return plans[::-1]


def pad(ids: Sequence[Sequence[int]], rows: Sequence[int], pad_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask [len(rows), pad_len] int64 for the texts `rows` of `ids`."""
    out = np.full((len(rows), pad_len), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), pad_len), dtype=np.int64)
    for k, i in enumerate(rows):
        out[k, :len(ids[i])] = ids[i]
        mask[k, :len(ids[i])] = 1
    return out, mask


@dataclass
class Batch:
    """One Triton batch between the stages: per-request errors, token ids, the plan, the output."""

    errors: list[TextError | None]  # per request; None = encoded (slots says where)
    slots: list[tuple[int, int, int]] = field(default_factory=list)  # (request, first row, rows)
    ids: list[list[int]] = field(default_factory=list)  # one row per text of the encoded requests
    plans: list[tuple[list[int], int]] = field(default_factory=list)  # (rows, padded length)
    out: np.ndarray | None = None
    row_errors: dict[int, TextError] = field(default_factory=dict)  # rows of failed sub-batches

    @property
    def real_tokens(self) -> int:
        return sum(len(row) for row in self.ids)

    @property
    def padded_tokens(self) -> int:
        return sum(len(rows) * pad_len for rows, pad_len in self.plans)

    @property
    def rejected(self) -> int:
        """Requests answered with an input error (bad input or too long)."""
        return sum(1 for e in self.errors if e is not None)


class TextPipeline:
    """The stages with their settings, tokenizers and encoder backend; one instance per model instance."""

    def __init__(self, settings: TextSettings, tokenizers: Tokenizers, backend: EncoderBackend, dim: int) -> None:
        self.settings, self.tok, self.backend, self.dim = settings, tokenizers, backend, dim

    def encode_pre(self, requests: Sequence[tuple[np.ndarray, str | None]]) -> Batch:
        """Decode and validate every request, tokenize the batch (one call per truncate mode), plan it."""
        batch = Batch(errors=[None] * len(requests))
        decoded: list[tuple[int, list[str], bool]] = []
        for r, (raw, parameters) in enumerate(requests):
            try:
                texts, truncate = decode(raw, parameters)
            except BadInput as exc:
                batch.errors[r] = exc
                continue
            decoded.append((r, texts, truncate))
        encoded: dict[int, list[list[int]]] = {}
        for truncate in (True, False):
            group = [(r, texts) for r, texts, t in decoded if t is truncate]
            flat = self.tok.encode([text for _, texts in group for text in texts], truncate)
            start = 0
            for r, texts in group:
                encoded[r], start = flat[start:start + len(texts)], start + len(texts)
        limit = self.settings.max_length
        for r, texts, truncate in decoded:
            over = [(j, len(row)) for j, row in enumerate(encoded[r]) if len(row) > limit]
            if over:
                j, n = over[0]
                batch.errors[r] = TooLong(f"text {j} has {n} tokens, over the limit of {limit}: shorten it or "
                                          "send truncate=true")
                continue
            batch.slots.append((r, len(batch.ids), len(texts)))
            batch.ids.extend(encoded[r])
        if batch.ids:
            s = self.settings
            batch.plans = plan_sub_batches([len(row) for row in batch.ids], s.token_budget, s.sub_batch_max,
                                           s.pad_to_multiple, s.split_overhead_tokens)
        return batch

    def overlapped(self, batch: Batch) -> bool:
        """True when the run stage should keep several sub-batches in flight (encode_core_async)."""
        return self.backend.overlaps and len(batch.plans) > 1 and self.settings.max_in_flight > 1

    def encode_core(self, batch: Batch) -> None:
        """Run every sub-batch, one after another; a failed sub-batch fails only its own rows."""
        batch.out = np.empty((len(batch.ids), self.dim), dtype=np.float32)
        with self.backend.hold():
            for rows, pad_len in batch.plans:
                try:
                    batch.out[rows] = self.backend.run(*pad(batch.ids, rows, pad_len, self.tok.pad_id))
                except TextError as exc:
                    batch.row_errors.update((i, exc) for i in rows)

    async def encode_core_async(self, batch: Batch) -> None:
        """encode_core with up to max_in_flight sub-batches waiting at the encoder at once."""
        batch.out = np.empty((len(batch.ids), self.dim), dtype=np.float32)
        window = asyncio.Semaphore(self.settings.max_in_flight)

        async def run(rows: list[int], pad_len: int) -> None:
            ids, mask = pad(batch.ids, rows, pad_len, self.tok.pad_id)
            async with window:
                try:
                    batch.out[rows] = await self.backend.arun(ids, mask)
                except TextError as exc:
                    batch.row_errors.update((i, exc) for i in rows)

        with self.backend.hold():
            await asyncio.gather(*(run(rows, pad_len) for rows, pad_len in batch.plans))

    def encode_post(self, batch: Batch) -> list[Any]:
        """Per request, in order: its [n, dim] embeddings, or the TextError that answers it."""
        results: list[Any] = list(batch.errors)
        for r, start, count in batch.slots:
            failed = [batch.row_errors[i] for i in range(start, start + count) if i in batch.row_errors]
            results[r] = failed[0] if failed else batch.out[start:start + count]
        return results

    def __call__(self, requests: Sequence[tuple[np.ndarray, str | None]]) -> list[Any]:
        """All stages, synchronously (tests and callers without an event loop)."""
        batch = self.encode_pre(requests)
        if self.overlapped(batch):
            asyncio.run(self.encode_core_async(batch))
        elif batch.plans:
            self.encode_core(batch)
        return self.encode_post(batch)

"""The text endpoint's first stages on one Triton batch: decode -> validate -> tokenize.

Pure (numpy and tokenizers only, no Triton): model.py feeds it each request's raw `text` array and
parameters, and hands the token ids to text_scheduler (plan -> pad -> run -> answer). plan_sub_batches
is the per-batch planner the bench's estimates price (loadtest.targets).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from text_core import BadInput, TextError, TextSettings, TokenizerFailed, TooLong, truthy
from tokenizers import Tokenizer

__all__ = ["decode", "Decoded", "DIRECTIONS", "Tokenizers", "plan_sub_batches", "Batch", "TextPipeline"]

DIRECTIONS = ("right", "left")  # request parameter truncation_direction: cut the end (default) or the start


class Decoded(NamedTuple):
    """One request after decode: its texts and request parameters."""

    texts: list[str]
    truncate: bool  # `truncate` (default true): cut texts over max_length, else refuse them
    priority: int  # `priority_level` (0: none sent)
    direction: str = "right"  # `truncation_direction`: "right" cuts the end, "left" the start


def decode(raw: npt.NDArray[Any], parameters: str | None = None) -> Decoded:
    """One request's texts and parameters (`truncate`, `priority_level`, `truncation_direction`); BadInput
    names the bad part."""
    params = json.loads(parameters or "{}")
    truncate = truthy(params.get("truncate", True))
    priority = params.get("priority_level", 0)  # Triton keeps its own "priority" from the model: the SDK sends both
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise BadInput(f"parameter priority_level={priority!r}: send an integer priority level >= 1 (1 = highest), "
                       "or none")
    direction = params.get("truncation_direction", "right")
    if not isinstance(direction, str) or direction.lower() not in DIRECTIONS:
        raise BadInput(f"parameter truncation_direction={direction!r}: send 'right' (cut the end, the default) or "
                       "'left' (cut the start)")
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
    return Decoded(texts, truncate, priority, direction.lower())


class Tokenizers:
    """The model's tokenizer three times: truncating the end (right) or the start (left) at max_length, and
    untruncated for exact counts (tokenizers' own truncation; [CLS] and [SEP] are kept either way)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int) -> None:
        self.max_length = max_length
        self.trunc = tokenizer
        self.trunc.no_padding()
        self.trunc.enable_truncation(max_length)
        self.left = Tokenizer.from_str(tokenizer.to_str())
        self.left.no_padding()
        self.left.enable_truncation(max_length, direction="left")
        self.full = Tokenizer.from_str(tokenizer.to_str())
        self.full.no_truncation()
        self.pad_id = self.full.token_to_id("[PAD]") or 0

    @classmethod
    def from_dir(cls, directory: str, max_length: int) -> Tokenizers:
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: run `bge-triton export --model-id <hub id or dir> "
                                    "--repository <repo> --model <name>`")
        return cls(Tokenizer.from_file(path), max_length)

    def encode(self, texts: list[str], truncate: bool, direction: str = "right") -> list[list[int]]:
        """Token ids of `texts` in ONE call (a lone text skips encode_batch's thread-pool hand-off)."""
        tok = (self.left if direction == "left" else self.trunc) if truncate else self.full
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


@dataclass
class Batch:
    """One Triton batch after the first stages: per-request errors, priorities, and the token ids."""

    errors: list[TextError | None]  # per request; None = encoded (slots says where)
    priorities: list[int] = field(default_factory=list)  # per request (0 = none sent)
    slots: list[tuple[int, int, int]] = field(default_factory=list)  # (request, first row, rows)
    ids: list[list[int]] = field(default_factory=list)  # one row per text of the encoded requests
    tokenize_us: int = 0  # wall time of encode_pre for the whole batch (decode, validate, tokenize)

    @property
    def rejected(self) -> int:
        """Requests answered with an input error (bad input or too long)."""
        return sum(1 for e in self.errors if e is not None and e.kind in ("bad_input", "too_long"))


class TextPipeline:
    """The first stages with their settings and tokenizers; one per model instance."""

    def __init__(self, settings: TextSettings, tokenizers: Tokenizers) -> None:
        self.settings, self.tok = settings, tokenizers

    def encode_pre(self, requests: Sequence[tuple[npt.NDArray[Any], str | None]]) -> Batch:
        """Decode and validate every request, tokenize the batch (one call per truncation mode). A tokenizer
        that raises fails only the requests it raised on (each retried alone), INTERNAL."""
        start_t = time.perf_counter()
        batch = Batch(errors=[None] * len(requests), priorities=[0] * len(requests))
        decoded: list[tuple[int, list[str], tuple[bool, str]]] = []
        for r, (raw, parameters) in enumerate(requests):
            try:
                d = decode(raw, parameters)
            except BadInput as exc:
                batch.errors[r] = exc
                continue
            except ValueError as exc:  # parameters that are not JSON (Triton always sends JSON: defensive)
                batch.errors[r] = BadInput(f"request parameters are not valid JSON: {exc}")
                continue
            batch.priorities[r] = d.priority
            decoded.append((r, d.texts, (d.truncate, d.direction if d.truncate else "right")))
        encoded: dict[int, list[list[int]]] = {}
        for mode in ((True, "right"), (True, "left"), (False, "right")):
            group = [(r, texts) for r, texts, m in decoded if m == mode]
            if not group:
                continue
            try:
                flat = self.tok.encode([text for _, texts in group for text in texts], *mode)
            except Exception:
                flat = None
            start = 0
            for r, texts in group:
                if flat is not None:
                    encoded[r], start = flat[start:start + len(texts)], start + len(texts)
                    continue
                try:
                    encoded[r] = self.tok.encode(texts, *mode)
                except Exception as exc:
                    batch.errors[r] = TokenizerFailed(f"the tokenizer failed on this request: {type(exc).__name__}: "
                                                      f"{exc}")
        limit = self.settings.max_length
        for r, texts, _mode in decoded:
            if r not in encoded:
                continue
            over = [(j, len(row)) for j, row in enumerate(encoded[r]) if len(row) > limit]
            if over:
                j, n = over[0]
                batch.errors[r] = TooLong(f"text {j} has {n} tokens, over the limit of {limit}: shorten it or "
                                          "send truncate=true")
                continue
            batch.slots.append((r, len(batch.ids), len(texts)))
            batch.ids.extend(encoded[r])
        batch.tokenize_us = int((time.perf_counter() - start_t) * 1e6)
        return batch

"""Tensor mode's client-side tokenization: HF `tokenizers`, truncation, and padding to length buckets.

Triton's dynamic batcher only merges requests whose input shapes are equal, so padding every
request to the smallest bucket >= its longest text (instead of to its own longest text) is what
lets concurrent tensor-mode requests share a batch.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bge_triton.client.errors import InputError, ModelConfigError

__all__ = ["BucketTokenizer", "pick_bucket", "effective_buckets", "pad_to_bucket"]


def effective_buckets(buckets: Sequence[int], max_length: int) -> tuple[int, ...]:
    """Buckets below max_length, plus max_length itself as the last bucket."""
    return tuple(sorted({b for b in buckets if b < max_length} | {max_length}))


def pick_bucket(longest: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= longest (buckets sorted); the last bucket if none is large enough."""
    for b in buckets:
        if b >= longest:
            return b
    return buckets[-1]


def pad_to_bucket(ids: Sequence[Sequence[int]], buckets: Sequence[int], pad_id: int = 0
                  ) -> tuple[NDArray[Any], NDArray[Any]]:
    """Right-pad token id lists to one bucket length; returns INT64 (input_ids, attention_mask)."""
    length = pick_bucket(max((len(x) for x in ids), default=1), buckets)
    input_ids = np.full((len(ids), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), length), dtype=np.int64)
    for row, seq in enumerate(ids):
        n = min(len(seq), length)
        input_ids[row, :n] = seq[:n]
        mask[row, :n] = 1
    return input_ids, mask


def load_tokenizer(source: str) -> tuple[Any, str | None]:
    """A `tokenizers.Tokenizer` from a tokenizer.json, its directory or a hub id, and the directory it came from."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - a base dependency
        raise ModelConfigError("tensor mode needs the `tokenizers` package: pip install tokenizers") from exc
    path = source
    if os.path.isdir(source):
        path = os.path.join(source, "tokenizer.json")
    if os.path.isfile(path):
        return Tokenizer.from_file(path), os.path.dirname(path)
    if os.path.sep in source and not os.path.exists(source):
        raise ModelConfigError(f"tokenizer={source!r} does not exist; point it at the dir the exporter wrote "
                               "(MODEL_REPOSITORY/<model>/1/tokenizer) or a hub id")
    try:
        return Tokenizer.from_pretrained(source), None
    except Exception as exc:  # hub/network errors vary; re-raised as a kit error
        raise ModelConfigError(f"cannot load tokenizer {source!r} ({exc}); give a local dir with "
                               "tokenizer.json (no hub access here)") from exc


def _declared_max_length(directory: str | None) -> int | None:
    """model_max_length from tokenizer_config.json, when it is a real limit."""
    if not directory:
        return None
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        value = json.load(fh).get("model_max_length")
    return int(value) if isinstance(value, (int, float)) and 0 < value < 100_000 else None


class BucketTokenizer:
    """Tokenize a batch, truncate to max_length (or reject with truncate=False), pad to a bucket."""

    def __init__(self, source: str, buckets: Sequence[int], max_length: int | None = None) -> None:
        self._tok, directory = load_tokenizer(source)
        self.max_length = int(max_length or _declared_max_length(directory) or max(buckets))
        self.buckets = effective_buckets(buckets, self.max_length)
        self._tok.no_padding()
        self._tok.enable_truncation(self.max_length)
        pad = self._tok.token_to_id("[PAD]")
        self.pad_id = 0 if pad is None else int(pad)

    def token_ids(self, texts: Sequence[str], truncate: bool = True) -> list[list[int]]:
        """Token ids per text (special tokens added, truncated to max_length)."""
        encodings = self._tok.encode_batch(list(texts))
        if not truncate:
            for i, enc in enumerate(encodings):
                if enc.overflowing:
                    self._tok.no_truncation()
                    try:
                        count = len(self._tok.encode(texts[i]).ids)
                    finally:
                        self._tok.enable_truncation(self.max_length)
                    raise InputError(f"texts[{i}] has {count} tokens, the limit is max_length={self.max_length}; "
                                     "shorten it or use truncate=True")
        return [enc.ids for enc in encodings]

    def encode(self, texts: Sequence[str], truncate: bool = True) -> tuple[NDArray[Any], NDArray[Any]]:
        """INT64 (input_ids, attention_mask) [n, bucket] for one request."""
        return pad_to_bucket(self.token_ids(texts, truncate), self.buckets, self.pad_id)

"""Text preparation with the text endpoint's own tokenizer: the query instruction, NIM's truncate
NONE | START | END, and the token counts that `usage` reports.

The gateway sends text (the server tokenizes again); it tokenizes here only to count, to reject an
over-long text with truncate=NONE before it reaches Triton, and to cut from the start for START.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from bge_triton.client.tokens import _load
from bge_triton.gateway.errors import BadRequest

__all__ = ["Prepared", "TextPreparer", "TRUNCATE_MODES"]

TRUNCATE_MODES = ("NONE", "START", "END")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What goes to Triton: the texts, whether the server may truncate (END), tokens per text."""

    texts: list[str]
    server_truncate: bool
    tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


class TextPreparer:
    """Counts tokens as the text endpoint does ([CLS] text [SEP], truncated at max_length)."""

    def __init__(self, tokenizer_dir: str, max_length: int, query_instruction: str) -> None:
        self._full, _ = _load(tokenizer_dir)
        self._full.no_padding()
        self._full.no_truncation()
        self._trunc, _ = _load(tokenizer_dir)
        self._trunc.no_padding()
        self.instruction = query_instruction
        self._specials = self._full.num_special_tokens_to_add(False)
        self.limit(max_length)

    def limit(self, max_length: int) -> None:
        """Set the token limit (the text endpoint's `max_length` parameter, read from Triton at connect)."""
        self.max_length = int(max_length)
        self._trunc.enable_truncation(self.max_length)

    def count(self, texts: Sequence[str], truncate: bool = True) -> list[int]:
        """Tokens per text as the model sees them (special tokens included)."""
        tok = self._trunc if truncate else self._full
        return [len(e.ids) for e in tok.encode_batch(list(texts))]

    def prepare(self, texts: Sequence[str], query: bool, truncate: str, param: str = "input") -> Prepared:
        """Add the instruction to queries, apply `truncate`, count tokens; BadRequest for NONE over the limit."""
        prefix = self.instruction if query else ""
        full = [prefix + t for t in texts]
        if truncate == "END":
            return Prepared(full, True, self.count(full, truncate=True))
        counts = self.count(full, truncate=False)
        if truncate == "NONE":
            for i, n in enumerate(counts):
                if n > self.max_length:
                    where = param if len(texts) == 1 else f"{param}[{i}]"
                    raise BadRequest(f"{where} has {n} tokens (with the model's special tokens"
                                     f"{' and the query instruction' if query else ''}), the limit is "
                                     f"{self.max_length}: shorten it, or send truncate END or START",
                                     param=param, code="context_length_exceeded")
            return Prepared(full, False, counts)
        out, out_counts = [], []
        for text, n in zip(texts, counts):
            if n > self.max_length:
                text = self._keep_tail(text, self.max_length - self._specials - self._prefix_tokens(prefix))
                n = self.count([prefix + text], truncate=False)[0]
            out.append(prefix + text)
            out_counts.append(n)
        return Prepared(out, True, out_counts)  # server truncation only guards a rare wordpiece re-merge

    def _prefix_tokens(self, prefix: str) -> int:
        return len(self._full.encode(prefix, add_special_tokens=False).ids) if prefix else 0

    def _keep_tail(self, text: str, budget: int) -> str:
        """The shortest suffix of text, cut at a word start, that holds at most `budget` tokens."""
        enc = self._full.encode(text, add_special_tokens=False)
        if budget <= 0:
            raise BadRequest(f"the query instruction alone fills the {self.max_length}-token limit",
                             param="input_type")
        k = len(enc.ids) - budget
        words = enc.word_ids
        while 0 < k < len(enc.ids) and words[k] is not None and words[k] == words[k - 1]:
            k += 1  # never start inside a word: the suffix then tokenizes as the same tokens
        return text[enc.offsets[k][0]:] if k < len(enc.ids) else text[-1:]

"""Text preparation before the Triton call: the query instruction, and NIM's truncate NONE | START | END.

The text endpoint tokenizes and counts (its `token_count` output is what `usage` reports), truncates
at the end (END) and refuses an over-long text when asked not to truncate (NONE). The gateway's own
copy of the server's tokenizer serves only what the endpoint cannot do: cut from the start (START),
and, after the endpoint refused a NONE request, name the over-long input and its token count.
"""
from __future__ import annotations

from typing import Sequence

from bge_triton.client.tokens import _load
from bge_triton.gateway.errors import BadRequest

__all__ = ["TextPreparer", "TRUNCATE_MODES"]

TRUNCATE_MODES = ("NONE", "START", "END")


class TextPreparer:
    """The text endpoint's tokenizer, loaded once: counts as the endpoint does ([CLS] text [SEP])."""

    def __init__(self, tokenizer_dir: str, max_length: int, query_instruction: str) -> None:
        self._full, _ = _load(tokenizer_dir)
        self._full.no_padding()
        self._full.no_truncation()
        self.instruction = query_instruction
        self._specials = self._full.num_special_tokens_to_add(False)
        self.limit(max_length)

    def limit(self, max_length: int) -> None:
        """Set the token limit (the text endpoint's `max_length` parameter, read from Triton at connect)."""
        self.max_length = int(max_length)

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text, untruncated, special tokens included."""
        return [len(e.ids) for e in self._full.encode_batch(list(texts))]

    def prepare(self, texts: list[str], query: bool, truncate: str) -> tuple[list[str], bool]:
        """The texts to send (instruction added for queries, START applied) and the endpoint's `truncate`."""
        prefix = self.instruction if query else ""
        full = [prefix + t for t in texts] if prefix else texts
        if truncate != "START":
            return full, truncate == "END"
        out = []
        for text, n in zip(texts, self.count(full)):
            if n > self.max_length:
                text = self._keep_tail(text, self.max_length - self._specials - self._prefix_tokens(prefix))
            out.append(prefix + text)
        return out, True  # the endpoint's own truncation only guards a rare wordpiece re-merge

    def check_lengths(self, texts: Sequence[str], query: bool, param: str = "input") -> None:
        """BadRequest naming the first text over the limit (after the endpoint refused truncate=NONE)."""
        prefix = self.instruction if query else ""
        for i, n in enumerate(self.count([prefix + t for t in texts])):
            if n > self.max_length:
                where = param if len(texts) == 1 else f"{param}[{i}]"
                raise BadRequest(f"{where} has {n} tokens (with the model's special tokens"
                                 f"{' and the query instruction' if query else ''}), the limit is "
                                 f"{self.max_length}: shorten it, or send truncate END or START",
                                 param=param, code="context_length_exceeded")

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

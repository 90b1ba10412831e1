"""The optional local tokenizer (--tokenizer / --model-repository): truncate START for a text endpoint older
than the one that reads `truncation_direction` (the current one cuts either side itself, and counts the
tokens: the gateway then tokenizes nothing). Runs in a worker thread through encode_batch, which releases
the GIL (HF tokenizers' batch call), so the event loop keeps serving meanwhile.
"""
from __future__ import annotations

from bge_triton.client.tokens import load_tokenizer
from bge_triton.gateway.errors import bad_request

__all__ = ["TextPreparer"]


class TextPreparer:
    """The text endpoint's tokenizer, loaded once: counts as the endpoint does ([CLS] text [SEP])."""

    def __init__(self, tokenizer_dir: str, max_length: int) -> None:
        self._full, _ = load_tokenizer(tokenizer_dir)
        self._full.no_padding()
        self._full.no_truncation()
        self._specials = self._full.num_special_tokens_to_add(False)
        self.max_length = int(max_length)

    def limit(self, max_length: int) -> None:
        """Set the token limit (the text endpoint's `max_length` parameter, read from Triton at connect)."""
        self.max_length = int(max_length)

    def keep_tails(self, texts: list[str], prefix: str) -> list[str]:
        """Each text over the limit (with prefix and special tokens) cut to the shortest suffix, at a word
        start, that fits: the tokens truncate START keeps."""
        budget = self.max_length - self._specials - (
            len(self._full.encode_batch([prefix], add_special_tokens=False)[0].ids) if prefix else 0)
        if budget <= 0:
            raise bad_request(f"the query instruction alone fills the {self.max_length}-token limit",
                              param="input_type")
        out = []
        for text, enc in zip(texts, self._full.encode_batch(list(texts), add_special_tokens=False), strict=True):
            k = len(enc.ids) - budget
            if k <= 0:
                out.append(text)
                continue
            words = enc.word_ids
            while 0 < k < len(enc.ids) and words[k] is not None and words[k] == words[k - 1]:
                k += 1  # never start inside a word: the suffix then tokenizes as the same tokens
            out.append(text[enc.offsets[k][0]:] if k < len(enc.ids) else text[-1:])
        return out

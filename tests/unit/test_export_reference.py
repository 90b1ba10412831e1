"""The verify probes the export writes: every kind present, the long ones past max length, tolerance per precision."""
from __future__ import annotations

from pathlib import Path

import pytest

from bge_triton.export.reference import PROBES, probe_texts, tolerance
from bge_triton.export.settings import Thresholds


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from bge_triton.export.synthetic import write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(Path(d), 512)
    return AutoTokenizer.from_pretrained(str(d))


def test_probes_cover_the_kinds_and_reach_max_length(tokenizer):
    probes = probe_texts(tokenizer, 64)
    names = [p[0] for p in probes]
    assert len(names) == len(set(names)) == len(PROBES) + 2
    assert {"zh_short", "en_short", "zh_long", "en_long", "special_tokens", "unknown", "whitespace"} <= set(names)
    for name, _, text in probes:
        n = len(tokenizer(text)["input_ids"])
        assert text and (n > 64 if name.endswith("_long") else n <= 64), (name, n)


def test_tolerance_per_precision():
    t = Thresholds()
    assert tolerance("fp32", t) == tolerance("fp16", t) == {"min_cosine": 0.999}
    assert tolerance("int8", t) == {"min_cosine": 0.98, "mean_cosine": 0.99}

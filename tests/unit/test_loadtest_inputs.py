"""Unit tests of what the load generator sends: corpora, request bodies, window histograms, shapes via locust glue."""
from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from bge_triton.errors import InputError
from bge_triton.loadtest import corpus, loadgen
from bge_triton.loadtest.stats import histogram_delta, histogram_percentile


def _split(body: bytes) -> tuple[dict, bytes]:
    hlen = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + hlen]), body[8 + hlen:]


def test_review_corpus_is_the_real_length_mix():
    prof = corpus.length_profile(corpus.load("reviews"))
    assert prof["n"] > 30_000
    assert prof["p50"] == pytest.approx(48, abs=3) and prof["p90"] == pytest.approx(175, abs=10)


def test_query_corpus_is_short_and_sampling_is_seeded():
    queries = corpus.load("queries")
    assert all(4 <= len(q) <= 24 for q in queries)
    assert corpus.sample("queries", 5, seed=3) == corpus.sample("queries", 5, seed=3)
    assert all(len(t) <= 10 for t in corpus.sample("reviews", 50, max_chars=10))
    with pytest.raises(InputError, match="unknown corpus"):
        corpus.load("tweets")


def test_text_request_is_triton_binary_bytes():
    header, payload = _split(loadgen.text_request("你好，世界"))
    (inp,) = header["inputs"]
    assert inp["name"] == "text" and inp["datatype"] == "BYTES" and inp["shape"] == [1, 1]
    assert inp["parameters"]["binary_data_size"] == len(payload)
    (n,) = struct.unpack("<I", payload[:4])
    assert payload[4:4 + n].decode("utf-8") == "你好，世界"


def test_tensor_bodies_have_ids_and_mask():
    bodies = loadgen.tensor_bodies(8, 10)
    header, payload = _split(bodies[0])
    assert [i["name"] for i in header["inputs"]] == ["input_ids", "attention_mask"]
    assert len(payload) == 2 * 8 * 8
    assert all(1 <= i < 1000 for i in np.frombuffer(payload[:64], "<i8").tolist())
    assert np.frombuffer(payload[64:], "<i8").tolist() == [1] * 8
    assert len(set(bodies)) == 10


def test_window_histogram_percentiles():
    before = {10: 5, 20: 5}
    after = {10: 95, 20: 10, 500: 1}
    win = histogram_delta(before, after)
    assert win == {10: 90, 20: 5, 500: 1}
    assert histogram_percentile(win, 50) == 10 and histogram_percentile(win, 100) == 500
    assert histogram_percentile(win, 99) == pytest.approx(20 + (500 - 20) * 0.05)  # rank 94.05 of 96, linear
    assert math.isnan(histogram_percentile({}, 50))


def test_load_result_merge_and_throughput():
    a = loadgen.LoadResult(window_s=2.0, ok=10, latencies_ms=[1.0], errors=1, first_error="x")
    a.merge(loadgen.LoadResult(window_s=2.0, ok=6, latencies_ms=[2.0], late=2))
    assert a.throughput == 8.0 and a.errors == 1 and a.late == 2 and a.latencies_ms == [1.0, 2.0]


def test_tensor_mix_bodies_pad_to_buckets_or_own_length(tmp_path):
    """The opt-in bench scenarios: the same reviews, padded to the SDK's buckets or to each text's length."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    from bge_triton.client.core import DEFAULT_BUCKETS
    from bge_triton.loadtest.bench import BenchSettings, scenario_bodies

    chars = sorted({c for t in corpus.load("reviews")[:2000] for c in t})
    tok = Tokenizer(WordLevel({c: i + 2 for i, c in enumerate(chars)} | {"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    (tmp_path / "m" / "1" / "tokenizer").mkdir(parents=True)
    tok.save(str(tmp_path / "m" / "1" / "tokenizer" / "tokenizer.json"))
    s = BenchSettings(real_repo=tmp_path, real_name="m", max_chars=256)
    widths = {}
    for scenario in ("tensor_buckets", "tensor_own_length"):
        shapes = set()
        for body in scenario_bodies(s, scenario, 16):
            header, payload = _split(body)
            ids, mask = header["inputs"]
            assert ids["name"] == "input_ids" and mask["name"] == "attention_mask" and ids["shape"] == mask["shape"]
            rows, width = ids["shape"]
            assert rows == 1 and len(payload) == 2 * 8 * width
            shapes.add(width)
        widths[scenario] = shapes
    assert widths["tensor_buckets"] <= set(DEFAULT_BUCKETS)
    assert len(widths["tensor_own_length"]) > 3 * len(widths["tensor_buckets"])  # many shapes: batches of ~1


def test_one_chart_one_traffic_text_endpoint_and_tensor_rows_carry_the_same_reviews(tmp_path):
    """bench seed's text endpoint gets the reviews that its tensor rows carry tokenized (padded to one length)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    from bge_triton.loadtest.bench import BenchSettings, scenario_bodies

    chars = sorted({c for t in corpus.load("reviews") for c in t})
    vocab = {c: i + 2 for i, c in enumerate(chars)}
    tok = Tokenizer(WordLevel(vocab | {"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    (tmp_path / "m" / "1" / "tokenizer").mkdir(parents=True)
    tok.save(str(tmp_path / "m" / "1" / "tokenizer" / "tokenizer.json"))
    (tmp_path / "m_onnx" / "1").mkdir(parents=True)
    (tmp_path / "m_onnx" / "1" / "model.onnx").write_bytes(b"")  # the export is there: nothing to export
    s = BenchSettings(real_repo=tmp_path, real_name="m", scenarios=("no_batching", "text_endpoint"))
    texts = [_split(b) for b in scenario_bodies(s, "text_endpoint", 24)]
    tensors = [_split(b) for b in scenario_bodies(s, "no_batching", 24)]
    assert len(texts) == len(tensors) == 256
    for (header, payload), (text_header, text_payload) in zip(tensors, texts, strict=True):
        assert header["inputs"][0]["shape"] == [1, 24] and text_header["inputs"][0]["name"] == "text"
        ids = np.frombuffer(payload[:8 * 24], dtype=np.int64)
        sent = text_payload[4:4 + int.from_bytes(text_payload[:4], "little")].decode()
        assert "".join(chars[i - 2] for i in ids if i > 1) == sent and 0 < len(sent) <= 24
    assert len({p for _, p in texts}) > 200  # distinct reviews

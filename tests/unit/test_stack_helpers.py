"""Pure helpers of the stack benchmark: padding arithmetic, batching rule, metrics parsing."""
from __future__ import annotations

import numpy as np

from bge_triton.loadtest import stack_bench


def test_pad_rows_pads_to_multiple_with_mask() -> None:
    ids, mask = stack_bench.pad_rows([[101, 5, 102], [101, 102]], 8)
    assert ids.shape == mask.shape == (2, 8) and ids.dtype == np.int64
    assert mask.sum(axis=1).tolist() == [3, 2]
    assert ids[1, :2].tolist() == [101, 102] and ids[1, 2:].sum() == 0


def test_sorted_batches_cover_every_text_once_sorted() -> None:
    rows = [[1] * n for n in (9, 3, 17, 5, 2)]
    batches = stack_bench.sorted_batches(rows, 2, 8)
    assert [b[0].shape for b in batches] == [(2, 8), (2, 16), (1, 24)]
    assert sum(int(m.sum()) for _, m in batches) == sum(len(r) for r in rows)


def test_fifo_padding_ratio() -> None:
    assert stack_bench.fifo_padding_ratio([4, 4, 4, 4], 2) == 1.0
    assert stack_bench.fifo_padding_ratio([1, 3], 2) == 6 / 4
    assert stack_bench.fifo_padding_ratio([1, 3], float("nan")) == 1.0  # no batch size seen: singles


def test_kit_counters_reads_only_this_models_kit_counters(monkeypatch) -> None:
    body = (b'# HELP kit_real_tokens_total x\n# TYPE kit_real_tokens_total counter\n'
            b'kit_real_tokens_total{model="m"} 120\n'
            b'kit_real_tokens_total{model="other"} 7\nkit_padded_tokens_total{model="m"} 1.32e+02\n'
            b'nv_inference_count{model="m",version="1"} 3\n')

    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return body

    monkeypatch.setattr(stack_bench.urllib.request, "urlopen", lambda url, timeout: Resp())
    got = stack_bench.kit_counters("http://127.0.0.1:18402/metrics", "m")
    assert got == {"kit_real_tokens_total": 120.0, "kit_padded_tokens_total": 132.0}


def test_split_of_c_by_tritons_statistics() -> None:
    from bge_triton.loadtest.stack_bench import StackResults, split_rows
    from bge_triton.loadtest.stats import flatten_stats, phase_means_ms

    def snap(n: int, ns: dict[str, int]) -> dict[str, float]:
        phases = {p: {"count": n, "ns": ns.get(p, 0)} for p in
                  ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")}
        return flatten_stats({"model_stats": [{"inference_count": n, "execution_count": n, "inference_stats": phases}]})

    before = snap(10, {"success": 10_000_000})
    after = snap(30, {"success": 90_000_000, "queue": 4_000_000, "compute_infer": 60_000_000})
    split = phase_means_ms(before, after)  # 20 requests: 80 ms in Triton, 4 ms queue, 60 ms infer
    assert split["success"] == 4.0 and split["queue"] == 0.2 and split["compute_infer"] == 3.0
    assert split["compute_input"] == 0.0 and "fail" not in split
    res = StackResults(header={}, sweep=[], rounds=[], latency={"stack": [5.0, 7.0]}, split=split)
    assert split_rows(res) == [["stack", "6.00", "4.00", "0.20", "0.00", "3.00", "0.00", "2.00"]]  # outside = 6 - 4
    assert split_rows(StackResults(header={}, sweep=[], rounds=[])) == []

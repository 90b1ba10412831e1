"""The GPU bench's pieces that need no server: configs (Triton's schema), sub-batch plans, FLOPs, goals."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from bge_triton.errors import PortInUse
from bge_triton.loadtest.gpu import assets, bench_gpu

REPO = Path(__file__).resolve().parents[2]


def _load_bert_model_module():
    """bert_model.py imports triton_python_backend_utils, which only exists inside the stub."""
    stub = type(sys)("triton_python_backend_utils")
    sys.modules.setdefault("triton_python_backend_utils", stub)
    spec = importlib.util.spec_from_file_location("bench_bert_model", bench_gpu.MODEL_SOURCE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_rendered_config_parses_with_tritons_schema(tmp_path: Path) -> None:
    scs = bench_gpu.build_scenarios(32, 1_000_000, 5000)
    assert [s.key for s in scs] == ["s1_batch1", "s2_static", "s3_dynamic", "s4_delay0",
                                    "s5a_mixed_padded", "s5b_mixed_length_aware"]
    root = bench_gpu.write_repository(tmp_path / "repo", scs, {"fixed": 64, "mixed": 256},
                                      dims=bench_gpu.MODEL_SIZES["large"], device="cuda", dtype="fp16",
                                      seed=0, token_budget=4096, instances=1)
    for sc in scs:
        cfg = text_format.Parse((root / sc.model_name / "config.pbtxt").read_text(),
                                model_config_pb2.ModelConfig())
        assert (root / sc.model_name / "1" / "model.py").exists()
        assert cfg.name == sc.model_name and cfg.backend == "python"
        assert cfg.max_batch_size == sc.max_batch
        assert list(cfg.input[0].dims) == [64 if sc.workload == "fixed" else 256]
        assert list(cfg.output[0].dims) == [1024]
        assert cfg.parameters["synthetic"].string_value == "true"
        assert cfg.parameters["model_id"].string_value == "synthetic:bge-large-zh"
        assert cfg.HasField("dynamic_batching") == (sc.delay_us is not None)
    s1, s2, s3, s4 = (text_format.Parse((root / f"bench_{k}" / "config.pbtxt").read_text(),
                                        model_config_pb2.ModelConfig())
                      for k in ("s1_batch1", "s2_static", "s3_dynamic", "s4_delay0"))
    assert s1.max_batch_size == 1 and not s1.HasField("dynamic_batching")
    assert list(s2.dynamic_batching.preferred_batch_size) == [32]
    assert s2.dynamic_batching.max_queue_delay_microseconds == 1_000_000
    assert s3.dynamic_batching.max_queue_delay_microseconds == 5000
    assert s4.dynamic_batching.max_queue_delay_microseconds == 0


def test_large_size_is_bge_large_zh_architecture() -> None:
    d = bench_gpu.MODEL_SIZES["large"]
    assert (d.layers, d.hidden, d.heads, d.intermediate, d.vocab) == (24, 1024, 16, 4096, 21128)
    # ~2 x 302M encoder weights per token, plus attention: 64 tokens ~ 39 GFLOP
    assert 35e9 < d.flops_per_sequence(64, 64 * 64) < 45e9


@pytest.mark.parametrize("padding", ["longest", "length_aware"])
def test_sub_batch_plans_cover_every_row_once(padding: str) -> None:
    mod = _load_bert_model_module()
    lengths = np.array([5, 200, 17, 64, 9, 130, 33, 1, 250])
    plans = mod.plan_sub_batches(lengths, padding, 8, 512)
    rows = np.concatenate([idx for idx, _ in plans])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for idx, width in plans:
        assert width >= lengths[idx].max()
        if padding == "length_aware":
            assert width % 8 == 0
            assert len(idx) == 1 or len(idx) * width <= 512
    if padding == "longest":
        assert len(plans) == 1 and plans[0][1] == 250


def test_as_given_runs_the_batch_at_its_own_width() -> None:
    """The text endpoint's sub-batches arrive planned and padded: one plan, every row, no cut."""
    plans = _load_bert_model_module().plan_sub_batches(np.array([3, 9, 16]), "as_given", 8, 4096)
    assert len(plans) == 1 and plans[0][0].tolist() == [0, 1, 2] and plans[0][1] is None


def test_length_aware_pads_fewer_tokens_than_longest() -> None:
    mod = _load_bert_model_module()
    lengths = np.random.default_rng(0).integers(4, 256, 64)
    def padded(p):
        return sum(len(i) * w for i, w in mod.plan_sub_batches(lengths, p, 8, 4096))
    assert padded("length_aware") < 0.75 * padded("longest")


def _row(key: str, qps: float, low_avg: float, frac: float) -> dict:
    return {"scenario": key, "peak_qps": qps, "low_avg_ms": low_avg, "peak_compute_frac": frac,
            "peak_model_tflops": 1.0}


def test_goals_against_batch1_of_the_same_run() -> None:
    rows = [_row("s1_batch1", 100.0, 5.0, 0.05), _row("s3_dynamic", 1000.0, 10.0, 0.5),
            _row("s4_delay0", 990.0, 5.9, 0.49)]
    verdict = {g: ok for g, _, ok in bench_gpu.evaluate_goals(rows)}
    assert verdict["s3_dynamic: peak throughput / batch-1 >= 10.0x"]
    assert not verdict["s3_dynamic: low-load avg latency - batch-1's <= 1.0 ms"]
    assert verdict["s3_dynamic: model compute at peak >= 50% of measured matmul rate"]
    assert not verdict["s4_delay0: peak throughput / batch-1 >= 10.0x"]
    assert verdict["s4_delay0: low-load avg latency - batch-1's <= 1.0 ms"]
    assert not verdict["s4_delay0: model compute at peak >= 50% of measured matmul rate"]
    assert not any(g.startswith("text_endpoint") for g in verdict)  # no text row, no text verdicts


def test_text_endpoint_goals_compare_model_flops_not_requests() -> None:
    base = _row("s1_batch1", 100.0, 5.0, 0.05)
    text = _row("text_endpoint", 50.0, 20.0, 0.55)  # fewer requests/s than s1, ten times its model FLOP/s
    text["peak_model_tflops"], base["peak_model_tflops"] = 11.0, 1.0
    verdict = {g: (m, ok) for g, m, ok in bench_gpu.evaluate_goals([base, text])}
    assert verdict["text_endpoint: peak model FLOP/s / batch-1's >= 10.0x"] == ("11.00x", True)
    assert verdict["text_endpoint: model compute at peak >= 50% of measured matmul rate"] == ("55.0%", True)
    text["peak_model_tflops"] = 9.9
    assert not dict((g, ok) for g, _, ok in bench_gpu.evaluate_goals([base, text]))[
        "text_endpoint: peak model FLOP/s / batch-1's >= 10.0x"]


@pytest.mark.parametrize(("flags", "taken", "starts"), [
    ([], 1, [(20000, 20001), (20002, 20003)]),  # a picked port taken at the first start: new picks, served
    ([], 3, [(20000, 20001), (20002, 20003), (20004, 20005)]),  # taken at every start: PortInUse after 3
    (["--http-port", "8000"], 1, [(8000, 20001)]),  # a port given by flag: taken is an error, no new pick
])
def test_serve_picks_ports_again_only_when_it_picked_them(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path,
                                                          flags: list[str], taken: int,
                                                          starts: list[tuple[int, int]]) -> None:
    picks, tried = iter(range(20000, 20100)), []
    monkeypatch.setattr(assets, "free_ports", lambda host, n=2: [next(picks) for _ in range(n)])

    @contextlib.contextmanager
    def tritonserver(wheel_dir, work_dir, repo, host, http, metrics, ready_timeout):
        tried.append((http, metrics))
        if len(tried) <= taken:
            raise PortInUse(f"a port is taken (--http-port {http}, --metrics-port {metrics})")
        yield f"http://{host}:{http}"

    monkeypatch.setattr(assets, "tritonserver", tritonserver)
    s = bench_gpu.parse_args(["--device", "cpu", *flags])
    if len(starts) > taken:
        assert bench_gpu.serve(s, tmp_path, lambda url: url) == f"http://127.0.0.1:{starts[-1][0]}"
    else:
        with pytest.raises(PortInUse, match=f"--http-port {starts[-1][0]}"):
            bench_gpu.serve(s, tmp_path, lambda url: url)
    assert tried == starts
    out = capsys.readouterr().out
    assert [f"start {k}/3" in out for k in (2, 3)] == [len(starts) >= k for k in (2, 3)]

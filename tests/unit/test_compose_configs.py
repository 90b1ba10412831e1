"""GPU model configs: Triton's schema, and only keys the 24.10 ONNX Runtime backend accepts."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_configs", REPO / "deploy" / "check_configs.py")
check_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_configs)

BASE = """
name: "m_onnx"
backend: "onnxruntime"
max_batch_size: 8
input { name: "input_ids" data_type: TYPE_INT64 dims: -1 }
output { name: "embedding" data_type: TYPE_FP32 dims: 1024 }
instance_group { kind: KIND_GPU count: 1 }
"""
TRT_OK = BASE + """
optimization { execution_accelerators { gpu_execution_accelerator {
  name: "tensorrt"
  parameters { key: "precision_mode" value: "FP16" }
  parameters { key: "max_workspace_size_bytes" value: "4294967296" }
  parameters { key: "trt_engine_cache_enable" value: "1" }
  parameters { key: "trt_engine_cache_path" value: "/engine_cache/bge_large_zh_onnx" }
  parameters { key: "trt_profile_min_shapes" value: "input_ids:1x1,attention_mask:1x1" }
  parameters { key: "trt_profile_opt_shapes" value: "input_ids:32x128,attention_mask:32x128" }
  parameters { key: "trt_profile_max_shapes" value: "input_ids:64x512,attention_mask:64x512" }
} } }
"""


def _cfg(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_committed_gpu_repository_passes() -> None:
    results = check_configs.check_repository(REPO / "src" / "bge_triton" / "model_repository")
    assert {p.parent.name for p in results} >= {"bge_large_zh", "bge_large_zh_onnx"}
    assert {str(p): probs for p, probs in results.items() if probs} == {}


def _docs_trt_config() -> str:
    """The committed encoder config with docs/gpu.md's TensorRT block put in, as the doc says to."""
    doc = (REPO / "docs" / "gpu.md").read_text()
    section = doc[doc.index("### TensorRT FP16"):]
    block = section[section.index("```") + 3:]
    block = block[block.index("\n") + 1:block.index("```")]
    config = (REPO / "src" / "bge_triton" / "model_repository" / "bge_large_zh_onnx" / "config.pbtxt").read_text()
    start = config.index("\noptimization {") + 1
    depth, end = 0, start
    for end in range(start, len(config)):
        depth += {"{": 1, "}": -1}.get(config[end], 0)
        if depth == 0 and config[end] == "}":
            break
    return config[:start] + block.strip() + config[end + 1:]


def test_trt_block_documented_in_docs_passes() -> None:
    assert check_configs.check_config(_cfg(TRT_OK)) == []
    text = _docs_trt_config()  # the doc's block replaces the config's one optimization block: it must parse
    assert text.count("\noptimization {") == 1
    cfg = _cfg(text)
    assert check_configs.check_config(cfg) == []
    assert cfg.optimization.input_pinned_memory.enable and cfg.optimization.output_pinned_memory.enable
    (trt,) = cfg.optimization.execution_accelerators.gpu_execution_accelerator
    assert trt.name == "tensorrt" and trt.parameters["precision_mode"] == "FP16"


@pytest.mark.parametrize("snippet, needle", [
    ('parameters { key: "trt_fp16_enable" value: "1" }', "unknown TensorRT accelerator parameter 'trt_fp16_enable'"),
    ('parameters { key: "trt_engine_hw_compatible" value: "1" }', "unknown TensorRT accelerator parameter"),
    ('parameters { key: "trt_ep_context_embed_mode" value: "2" }', "trt_ep_context_embed_mode must be 0"),
    ('parameters { key: "trt_dump_ep_context_model" value: "yes" }', "must be 0/1/true/false"),
    ('parameters { key: "trt_ep_context_file_path" value: "/tmp/ctx.onnx" }', "not under the engine-cache volume"),
    ('parameters { key: "precision_mode" value: "BF16" }', "precision_mode 'BF16'"),
    ('parameters { key: "max_workspace_size_bytes" value: "4GB" }', "must be an integer"),
    ('parameters { key: "trt_engine_cache_enable" value: "yes" }', "must be 0/1/true/false"),
    ('parameters { key: "trt_engine_cache_path" value: "/tmp/engines" }', "not under the engine-cache volume"),
])
def test_bad_tensorrt_parameters_are_named(snippet: str, needle: str) -> None:
    text = BASE + ('optimization { execution_accelerators { gpu_execution_accelerator { name: "tensorrt" '
                   + snippet + " } } }")
    problems = check_configs.check_config(_cfg(text))
    assert any(needle in p for p in problems), problems


def test_unknown_accelerators_and_cuda_keys() -> None:
    text = BASE + """optimization { execution_accelerators {
      gpu_execution_accelerator { name: "tensorrt_llm" }
      gpu_execution_accelerator { name: "cuda" parameters { key: "cudnn_conv_use_max_workspace" value: "1" }
                                              parameters { key: "use_flash" value: "1" } }
      cpu_execution_accelerator { name: "dnnl" } } }"""
    problems = check_configs.check_config(_cfg(text))
    assert any("unknown gpu_execution_accelerator 'tensorrt_llm'" in p for p in problems)
    assert any("unknown CUDA EP option 'use_flash'" in p for p in problems)
    assert not any("cudnn_conv_use_max_workspace" in p for p in problems)
    assert any("unknown cpu_execution_accelerator 'dnnl'" in p for p in problems)


def test_cpu_instances_and_python_models(tmp_path: Path) -> None:
    cpu = BASE.replace("KIND_GPU", "KIND_CPU")
    assert any("KIND_CPU" in p for p in check_configs.check_config(_cfg(cpu)))
    python = 'name: "t" backend: "python" max_batch_size: 4 instance_group { kind: KIND_CPU }'
    assert check_configs.check_config(_cfg(python)) == []  # the text endpoint runs on CPU by design
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text('name: "x" max_batch_sise: 4')
    (problem,) = check_configs.check_repository(tmp_path)[tmp_path / "broken" / "config.pbtxt"]
    assert "not a valid Triton model config" in problem
    assert check_configs.main([str(tmp_path)]) == 1

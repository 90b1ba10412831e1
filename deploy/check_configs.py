"""Check the GPU model repository before a deployment: Triton's schema + keys the ORT backend accepts.

    python deploy/check_configs.py model_repository [--engine-cache /engine_cache]

The onnxruntime backend of Triton 24.10 fails the model load on an unknown TensorRT accelerator
parameter or an unknown accelerator name, so a typo costs a whole GPU start-up; this catches it
here. Allowed keys follow src/onnxruntime.cc of triton-inference-server/onnxruntime_backend
(r24.10: its ParseTensorRTOptions), EP-context keys included (trt_dump_ep_context_model,
trt_ep_context_file_path, trt_ep_context_embed_mode); later ones (precision BF16, trt_engine_hw_compatible,
trt_onnx_bytestream, ...) are rejected on purpose.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

GPU_ACCELERATORS = {"tensorrt", "cuda"}
CPU_ACCELERATORS = {"openvino"}
TRT_KEYS = {
    "precision_mode", "max_workspace_size_bytes", "trt_max_partition_iterations",
    "trt_min_subgraph_size", "int8_calibration_table_name", "int8_use_native_calibration_table",
    "trt_dla_enable", "trt_dla_core", "trt_engine_cache_enable", "trt_engine_cache_path",
    "trt_engine_cache_prefix", "trt_dump_subgraphs", "trt_force_sequential_engine_build",
    "trt_context_memory_sharing_enable", "trt_layer_norm_fp32_fallback", "trt_timing_cache_enable",
    "trt_timing_cache_path", "trt_force_timing_cache", "trt_detailed_build_log",
    "trt_build_heuristics_enable", "trt_sparsity_enable", "trt_builder_optimization_level",
    "trt_auxiliary_streams", "trt_tactic_sources", "trt_extra_plugin_lib_paths",
    "trt_profile_min_shapes", "trt_profile_max_shapes", "trt_profile_opt_shapes",
    "trt_cuda_graph_enable",
    # EP context model (a serialized engine next to the ONNX file): dump it once, load it on later starts
    "trt_dump_ep_context_model", "trt_ep_context_file_path", "trt_ep_context_embed_mode",
}
TRT_PRECISIONS = {"FP32", "FP16", "INT8"}
TRT_BOOL_KEYS = {k for k in TRT_KEYS if k.endswith(("_enable", "_build", "_fallback", "_subgraphs",
                                                    "_cache", "_table"))} - {"trt_engine_cache_path"}
TRT_BOOL_KEYS |= {"trt_dump_ep_context_model"}
TRT_INT_KEYS = {"max_workspace_size_bytes", "trt_max_partition_iterations", "trt_min_subgraph_size",
                "trt_dla_core", "trt_builder_optimization_level", "trt_auxiliary_streams",
                "trt_ep_context_embed_mode"}
# paths that must persist across restarts: under the engine-cache volume
TRT_CACHE_PATHS = ("trt_engine_cache_path", "trt_ep_context_file_path")
# the backend passes CUDA EP keys straight to ONNX Runtime 1.19, which rejects unknown ones
CUDA_KEYS = {
    "device_id", "gpu_mem_limit", "arena_extend_strategy", "cudnn_conv_algo_search",
    "do_copy_in_default_stream", "cudnn_conv_use_max_workspace", "cudnn_conv1d_pad_to_nc1d",
    "enable_cuda_graph", "enable_skip_layer_norm_strict_mode", "prefer_nhwc",
    "use_ep_level_unified_stream", "use_tf32", "tunable_op_enable", "tunable_op_tuning_enable",
    "tunable_op_max_tuning_duration_ms", "gpu_external_alloc", "gpu_external_free",
    "gpu_external_empty_cache",
}
BOOL_VALUES = {"0", "1", "true", "false"}


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    """Parse a config.pbtxt with Triton's own schema; raises ValueError naming the file."""
    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"{path}: not a valid Triton model config: {exc}") from exc


def _check_trt(name: str, params: dict[str, str], engine_cache: str | None) -> list[str]:
    problems = []
    for key, value in params.items():
        if key not in TRT_KEYS:
            problems.append(f"{name}: unknown TensorRT accelerator parameter '{key}' (Triton 24.10 "
                            f"fails the load); allowed: {', '.join(sorted(TRT_KEYS))}")
        elif key == "precision_mode" and value not in TRT_PRECISIONS:
            problems.append(f"{name}: precision_mode '{value}' not in {sorted(TRT_PRECISIONS)}")
        elif key in TRT_INT_KEYS and not value.lstrip("-").isdigit():
            problems.append(f"{name}: TensorRT parameter {key}='{value}' must be an integer")
        elif key in TRT_BOOL_KEYS and value.lower() not in BOOL_VALUES:
            problems.append(f"{name}: TensorRT parameter {key}='{value}' must be 0/1/true/false")
    for key in TRT_CACHE_PATHS:
        where = params.get(key)
        if engine_cache and where is not None and not (where + "/").startswith(engine_cache.rstrip("/") + "/"):
            problems.append(f"{name}: {key} '{where}' is not under the engine-cache volume "
                            f"'{engine_cache}' of docker-compose.yml: engines would be rebuilt every start")
    if params.get("trt_ep_context_embed_mode", "0") not in ("0", "1"):
        problems.append(f"{name}: trt_ep_context_embed_mode must be 0 (engine in its own file) or 1 (embedded)")
    path = params.get("trt_engine_cache_path")
    if params.get("trt_engine_cache_enable", "0").lower() in ("1", "true") and path is None:
        problems.append(f"{name}: trt_engine_cache_enable without trt_engine_cache_path: set it under "
                        f"'{engine_cache or '/engine_cache'}'")
    return problems


def check_config(cfg: model_config_pb2.ModelConfig, engine_cache: str | None = "/engine_cache") -> list[str]:
    """Problems that would fail or degrade the model on the 24.10 GPU server ([] = fine)."""
    name = cfg.name or "<unnamed>"
    if cfg.backend != "onnxruntime" and cfg.platform != "onnxruntime_onnx":
        return []
    problems = []
    if any(g.kind == model_config_pb2.ModelInstanceGroup.KIND_CPU for g in cfg.instance_group):
        problems.append(f"{name}: instance_group KIND_CPU in the GPU repository; use KIND_GPU")
    accel = cfg.optimization.execution_accelerators
    for ea in accel.gpu_execution_accelerator:
        params = dict(ea.parameters)
        if ea.name not in GPU_ACCELERATORS:
            problems.append(f"{name}: unknown gpu_execution_accelerator '{ea.name}'; "
                            f"use one of {sorted(GPU_ACCELERATORS)}")
        elif ea.name == "tensorrt":
            problems += _check_trt(name, params, engine_cache)
        else:
            problems += [f"{name}: unknown CUDA EP option '{k}' (ONNX Runtime 1.19 rejects it)"
                         for k in params if k not in CUDA_KEYS]
    problems += [f"{name}: unknown cpu_execution_accelerator '{ea.name}'"
                 for ea in accel.cpu_execution_accelerator if ea.name not in CPU_ACCELERATORS]
    return problems


def check_repository(root: Path, engine_cache: str | None = "/engine_cache") -> dict[Path, list[str]]:
    """Every <root>/*/config.pbtxt -> its problems (a parse failure is one problem)."""
    out: dict[Path, list[str]] = {}
    for path in sorted(root.glob("*/config.pbtxt")):
        try:
            out[path] = check_config(parse_config(path), engine_cache)
        except ValueError as exc:
            out[path] = [str(exc)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path, nargs="?", default=Path("model_repository"))
    p.add_argument("--engine-cache", default="/engine_cache",
                   help="where docker-compose.yml mounts the TensorRT engine cache ('' to skip)")
    a = p.parse_args(argv)
    results = check_repository(a.repository, a.engine_cache or None)
    if not results:
        print(f"{a.repository}: no */config.pbtxt found", file=sys.stderr)
        return 1
    bad = 0
    for path, problems in results.items():
        print(f"{'FAIL' if problems else 'ok  '} {path}")
        for problem in problems:
            print(f"     {problem}")
        bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Render the local CPU variant of a model repository for the pytriton tritonserver (no ORT backend).

Each onnxruntime-backend model becomes a python-backend model of the same name, inputs, outputs,
max_batch_size and dynamic_batching, running ONNX Runtime on CPU (or the calibrated cost model).
Model files are symlinked, never copied.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from server.repository import Batching, apply_batching, iter_models, load_config, set_param, write_config

CPU_MODELS = Path(__file__).resolve().parent / "cpu_models"
ONNX_MODEL_PY = CPU_MODELS / "onnx_model.py"


@dataclass(frozen=True)
class CpuVariant:
    """How to render: executor for encoders, threads, cost model, per-model batching overrides."""

    executor: str = "onnxruntime"  # or "costmodel"
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default (all cores)
    allow_spinning: bool = False  # ORT spin-waiting: lower latency, but steals cores shared with Triton
    cost_a_us: float = 6260.0  # fitted to the seed A10G rows at L=64 (loadtest.costmodel)
    cost_b_us: float = 10.0
    keep_warmup: bool = False
    models: tuple[str, ...] | None = None  # None = every model in the repository
    batching: dict[str, Batching] = field(default_factory=dict)
    text_params: dict[str, str] = field(default_factory=dict)


def cpu_config(cfg: mc.ModelConfig, variant: CpuVariant) -> mc.ModelConfig:
    """The CPU variant of one config: python backend for onnxruntime models, KIND_CPU everywhere."""
    out = mc.ModelConfig()
    out.CopyFrom(cfg)
    if out.backend == "onnxruntime" or out.platform == "onnxruntime_onnx":
        out.backend = "python"
        out.ClearField("platform")
        out.ClearField("default_model_filename")
        out.ClearField("optimization")
        set_param(out, "executor", variant.executor)
        set_param(out, "intra_op_threads", variant.intra_op_threads)
        set_param(out, "allow_spinning", "1" if variant.allow_spinning else "0")
        set_param(out, "cost_a_us", variant.cost_a_us)
        set_param(out, "cost_b_us", variant.cost_b_us)
        if not variant.keep_warmup:
            out.ClearField("model_warmup")
    elif out.backend == "python":
        for key, value in variant.text_params.items():
            set_param(out, key, value)
    del out.instance_group[:]
    group = out.instance_group.add()
    group.kind = mc.ModelInstanceGroup.KIND_CPU
    group.count = max((g.count for g in cfg.instance_group), default=1) or 1
    if cfg.name in variant.batching:
        out = apply_batching(out, variant.batching[cfg.name])
    return out


def _link_tree(src: Path, dst: Path) -> None:
    """Mirror src into dst with symlinked files (cheap for GB-sized model files)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir():
            _link_tree(item, target)
        else:
            os.symlink(item.resolve(), target)


def render_cpu_variant(repository: Path, out_dir: Path, variant: CpuVariant = CpuVariant()) -> Path:
    """Write the CPU variant of `repository` into `out_dir` (replaced) and return it."""
    repository, out_dir = Path(repository), Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for name, model_dir in iter_models(repository):
        if variant.models is not None and name not in variant.models:
            continue
        cfg = load_config(model_dir)
        cpu = cpu_config(cfg, variant)
        dst = out_dir / name
        for version in (p for p in model_dir.iterdir() if p.is_dir()):
            _link_tree(version, dst / version.name)
        if cpu.backend == "python" and cfg.backend != "python":
            (dst / "1").mkdir(parents=True, exist_ok=True)  # model.py goes there even before an export
            for version in (p for p in dst.iterdir() if p.is_dir() and p.name.isdigit()):
                model_py = version / "model.py"
                if model_py.exists() or model_py.is_symlink():
                    model_py.unlink()
                shutil.copyfile(ONNX_MODEL_PY, model_py)
        write_config(cpu, dst / "config.pbtxt", "python -m server up (CPU variant, rendered at start)")
    return out_dir

"""Render the local CPU variant of a model repository for the pytriton tritonserver (no ORT backend).

Each onnxruntime-backend model becomes a python-backend model of the same name, inputs, outputs,
max_batch_size and dynamic_batching, running ONNX Runtime on CPU (or the calibrated cost model).
The text endpoint keeps the shipped model.py; with a CPU encoder it gets the in-process ONNX Runtime
backend (cpu_models/encoder_inprocess.py, copied beside model.py) through its `encoder` setting.
Model files are symlinked, never copied.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.errors import ModelConfigError
from bge_triton.repository import (
    Batching,
    apply_batching,
    iter_models,
    load_config,
    set_param,
    set_text_settings,
    text_settings,
    write_config,
)

CPU_MODELS = Path(__file__).resolve().parent / "cpu_models"
ONNX_MODEL_PY = CPU_MODELS / "onnx_model.py"
# encoder "X" of the text endpoint loads the module encoder_X.py beside its model.py.
TEXT_BACKENDS = {"inprocess": CPU_MODELS / "encoder_inprocess.py"}

# The text endpoint in front of a CPU encoder (executor onnxruntime): overrides of its settings, whose
# defaults live in model_repository/bge_large_zh/1/text_core.py. Each was measured with
# `python -m bge_triton.loadtest.stack_bench` (reports/stack; docs/architecture.md, "Local CPU variant"):
# - encoder "inprocess": the text endpoint runs the encoder's model.onnx itself. On the GPU the encoder is
#   the C++ onnxruntime backend and BLS stays inside the server; here the stand-in encoder is a second
#   python stub: one fixed text added 2.61 ms over raw ORT through BLS and 1.87 ms in-process
#   (`python -m bge_triton.loadtest.hop_latency`, reports/stack/hops_spin_on.md). The encoder model stays
#   loaded for tensor-mode clients; encoder "bls" keeps the GPU topology.
# - TWO instances that take turns on the cores (cpu_lock): ONNX Runtime uses every core for one run, so
#   the runs of all instances (and of the encoder model's) hold one file lock in the repository. Triton 2.51's
#   dynamic batcher can miss the wake-up for a request that reaches a busy single instance when nothing
#   arrives after it, and the request then waits for the batcher's 500 ms idle timeout; with a second
#   instance such a request is taken at once, tokenized while the first instance's run holds the cores, and
#   run as soon as it ends (ORT was busy 99% of a saturated window in a one-off instrumented run). The
#   text endpoint's dispatcher holds the lock around each sub-batch (max_in_flight 1: one dispatcher, as
#   ORT already uses every core). Without the lock, two instances oversubscribe the cores. Real CPU rows
#   (reports/bench vs reports/bench/cpu_no_lock): delay 0 peak p99 131 vs 595 ms; text endpoint low-load p99
#   93 vs 128 ms.
# - Sub-batches of at most 8 texts and 2048 tokens: ORT on CPU costs about 140 us per token from B=4 up,
#   with almost no fixed cost per call, so bigger sub-batches only add padding; a split pays off from
#   about 16 tokens of saved padding (split_overhead_tokens).
CPU_TEXT_PARAMS = {"encoder": "inprocess", "max_in_flight": "1", "sub_batch_max": "8", "token_budget": "2048",
                   "split_overhead_tokens": "16"}
CPU_TEXT_INSTANCES = 2


@dataclass(frozen=True)
class CpuVariant:
    """How to render: executor for encoders, threads, cost model, per-model batching overrides."""

    executor: str = "onnxruntime"  # or "costmodel"
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default (all cores)
    # ORT spin-waiting inside a run, stopped when the run returns (session.force_spinning_stop), so idle
    # threads steal no cores from Triton, the stubs and the clients. Measured by loadtest.stack_bench: the
    # batch-1 latency of spin-off ORT was 0.8 ms worse (reports/stack); spinning that outlived the run cost (b)
    # about 15% in a one-off quick run.
    allow_spinning: bool = True
    cost_a_us: float = 6260.0  # fitted to the seed A10G rows at L=64 (loadtest.costmodel)
    cost_b_us: float = 10.0
    keep_warmup: bool = False
    models: tuple[str, ...] | None = None  # None = every model in the repository
    batching: dict[str, Batching] = field(default_factory=dict)
    # Text settings overridden on the text endpoint (keys of text_core.TextSettings). None: CPU_TEXT_PARAMS
    # with the onnxruntime executor, the config's own with the cost model (an emulated GPU keeps the GPU's).
    text_params: dict[str, str] | None = None
    # None: CPU_TEXT_INSTANCES with onnxruntime (one with cpu_lock off), else the config's count.
    text_instances: int | None = None
    # None: two with onnxruntime, taking turns on the cores through cpu_lock (one with the lock off: a run
    # already uses every core), the config's count with the cost model (instances share one emulated GPU).
    encoder_instances: int | None = None
    # ONNX Runtime models (the encoder, and the text endpoint's in-process encoder) run one at a time
    # through the repository's .cpu_compute.lock; without it more than one instance oversubscribes the cores.
    cpu_lock: bool = True

    def resolved_text_params(self) -> dict[str, str]:
        """The parameters this variant sets on the text endpoint."""
        if self.text_params is not None:
            return dict(self.text_params)
        return dict(CPU_TEXT_PARAMS) if self.executor == "onnxruntime" else {}

    def resolved_text_instances(self) -> int | None:
        """Instance count of the text endpoint (None keeps the config's)."""
        if self.text_instances is not None:
            return self.text_instances
        if self.executor != "onnxruntime":
            return None
        return CPU_TEXT_INSTANCES if self.cpu_lock else 1


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
        if variant.executor == "onnxruntime":
            set_param(out, "cpu_lock", "1" if variant.cpu_lock else "0")
        if not variant.keep_warmup:
            out.ClearField("model_warmup")
    count = max((g.count for g in cfg.instance_group), default=1) or 1
    if out.backend == "python" and cfg.backend != "python":  # an encoder rendered for CPU
        if variant.encoder_instances is not None:
            count = variant.encoder_instances
        elif variant.executor == "onnxruntime":
            count = 2 if variant.cpu_lock else 1
    if is_text_endpoint(cfg):
        _set_text_params(out, variant)
        count = variant.resolved_text_instances() or count
    del out.instance_group[:]
    group = out.instance_group.add()
    group.kind = mc.ModelInstanceGroup.KIND_CPU
    group.count = count
    if cfg.name in variant.batching:
        out = apply_batching(out, variant.batching[cfg.name])
    return out


def is_text_endpoint(cfg: mc.ModelConfig) -> bool:
    """A python model that names its encoder (parameter onnx_model): the kit's text endpoint."""
    return cfg.backend == "python" and "onnx_model" in cfg.parameters


def _set_text_params(out: mc.ModelConfig, variant: CpuVariant) -> None:
    """The variant's text settings, typed and checked through text_core.TextSettings."""
    base = text_settings(out)
    overrides = variant.resolved_text_params()
    params = {**base.to_params(), **overrides}
    unknown = set(overrides) - set(base.keys())
    if unknown:
        raise ModelConfigError(f"CpuVariant.text_params {sorted(unknown)} are not text endpoint settings; use "
                               f"one of {list(base.keys())}")
    try:
        settings = type(base).from_params(params, out.name)
    except ValueError as exc:
        raise ModelConfigError(f"CpuVariant.text_params: {exc}") from exc
    if settings.encoder != "bls" and settings.encoder not in TEXT_BACKENDS:
        raise ModelConfigError(f"text endpoint encoder={settings.encoder!r}: use 'bls' or one of "
                               f"{sorted(TEXT_BACKENDS)}")
    set_text_settings(out, settings)
    if settings.encoder == "inprocess":  # the backend's own knobs: the same ORT threading as the encoder model
        set_param(out, "intra_op_threads", variant.intra_op_threads)
        set_param(out, "allow_spinning", "1" if variant.allow_spinning else "0")
        set_param(out, "cpu_lock", "1" if variant.cpu_lock else "0")


def _link_tree(src: Path, dst: Path) -> None:
    """Mirror src into dst with symlinked files (cheap for GB-sized model files)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir():
            _link_tree(item, target)
        else:
            os.symlink(item.resolve(), target)


def _install_text_backend(model_dir: Path, encoder: str) -> None:
    """Beside each version's model.py: the modules of model.py's own folder, and the encoder backend module.

    A model.py linked from elsewhere (e.g. this checkout's) brings its own text_core / text_stages.
    """
    for version in (p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()):
        model_py = version / "model.py"
        if not model_py.exists():
            continue
        home = model_py.resolve().parent
        for src in (p for p in home.glob("*.py") if p.name != "model.py"):
            target = version / src.name
            if target.is_symlink() or target.exists():
                target.unlink()
            os.symlink(src.resolve(), target)
        if encoder in TEXT_BACKENDS:
            target = version / TEXT_BACKENDS[encoder].name
            if target.is_symlink() or target.exists():
                target.unlink()
            shutil.copyfile(TEXT_BACKENDS[encoder], target)


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
        if is_text_endpoint(cpu):
            _install_text_backend(dst, text_settings(cpu).encoder)
        write_config(cpu, dst / "config.pbtxt", "bge-triton serve up (CPU variant, rendered at start)")
    return out_dir

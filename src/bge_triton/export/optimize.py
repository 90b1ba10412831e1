"""ONNX Runtime transformer fusion, then FP16 (GPU, float32 I/O) or INT8 (CPU) conversion of the embedding graph."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from bge_triton.errors import ExportError

from .onnx_export import MAX_IR_VERSION, save_external
from .source import ModelSource


@dataclass(frozen=True)
class Int8Recipe:
    """A dynamic INT8 quantisation recipe: which ops, per-channel or not, and which nodes stay float."""

    name: str
    method: str = "dynamic"  # dynamic: quantize_dynamic (int8 weights + activations); nbits: MatMulNBits weight-only
    op_types: tuple[str, ...] = ("MatMul", "Attention", "Gather")
    per_channel: bool = False
    reduce_range: bool = False
    exclude: tuple[str, ...] = ()  # node-name patterns: "ffn_out" = each layer's FFN output projection
    extra: dict = field(default_factory=dict)
    block_size: int = 32  # nbits only: weights per quantisation block
    accuracy_level: int | None = None  # nbits only: 4 = int8 compute (activations quantised per block)


# Measured on all-MiniLM-L6-v2 against its FP32 graph (reports/export/fidelity.md): the quantize_dynamic recipes
# (per-tensor activation scales) miss the top-10 bar; 8-bit blockwise MatMulNBits with int8 compute
# (accuracy_level 4: activations quantised per block of 32, per token) holds every bar. It is the default.
RECIPES: dict[str, Int8Recipe] = {
    "plain": Int8Recipe("plain"),
    "per-channel": Int8Recipe("per-channel", per_channel=True),
    "matmul-pc": Int8Recipe("matmul-pc", op_types=("MatMul",), per_channel=True),
    "matmul-pc-ffn-float": Int8Recipe("matmul-pc-ffn-float", op_types=("MatMul",), per_channel=True,
                                      exclude=("ffn_out",)),
    "nbits8-weight-only": Int8Recipe("nbits8-weight-only", method="nbits", block_size=32),
    "nbits8": Int8Recipe("nbits8", method="nbits", block_size=32, accuracy_level=4),
    "nbits8-b128": Int8Recipe("nbits8-b128", method="nbits", block_size=128, accuracy_level=4),
}
DEFAULT_RECIPE = "nbits8"


def fuse(src: Path, dst: Path, source: ModelSource, use_gpu: bool, external_data: bool = False) -> dict[str, int]:
    """Fuse attention / LayerNorm / GELU with onnxruntime.transformers for this model's heads and hidden size.

    Symbolic shape inference is off: it copies the graph with its weights several times and set the export's peak
    memory on BGE-Large-zh (docs/export.md); the same fusions happen (statistics in the report) and validation
    checks the result against PyTorch.
    """
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    for name in ("onnxruntime.transformers", "fusion_skiplayernorm"):  # the latter warns that shape inference is off
        logging.getLogger(name).setLevel(logging.ERROR)
    options = FusionOptions("bert")
    options.enable_shape_inference = False
    try:
        opt = optimize_model(str(src), model_type="bert", num_heads=source.heads, hidden_size=source.hidden,
                             opt_level=0, use_gpu=use_gpu, optimization_options=options)
    except (RuntimeError, ValueError, AssertionError) as err:
        raise ExportError(f"ONNX Runtime fusion failed for {src} (heads {source.heads}, hidden {source.hidden}): {err}") from err
    stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}
    opt.model.ir_version = min(opt.model.ir_version, MAX_IR_VERSION)
    if external_data:
        save_external(opt.model, dst)
    else:
        opt.save_model_to_file(str(dst))
    return stats


def to_fp16(src: Path, dst: Path) -> None:
    """Weights and activations in FP16, inputs/outputs stay int64/float32 so clients need not change."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    m = OnnxModel(onnx.load(str(src)))
    m.convert_float_to_float16(keep_io_types=True)
    m.model.ir_version = min(m.model.ir_version, MAX_IR_VERSION)
    m.save_model_to_file(str(dst))


def _ffn_out_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of each layer's FFN output MatMul (input = GELU output): the most outlier-prone activations in BERT."""
    gelu_outputs = {o for n in model.graph.node if n.op_type in ("Gelu", "BiasGelu", "FastGelu") for o in n.output}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[0] in gelu_outputs]


def exclusions(model: onnx.ModelProto, recipe: Int8Recipe) -> list[str]:
    """Node names the recipe keeps in float."""
    names: list[str] = []
    for pattern in recipe.exclude:
        if pattern == "ffn_out":
            names += _ffn_out_nodes(model)
        else:
            names += [n.name for n in model.graph.node if pattern in n.name]
    return names


def _weight_only(src: Path, dst: Path, recipe: Int8Recipe, excluded: list[str]) -> None:
    """8-bit blockwise weight-only MatMul quantisation (MatMulNBits); activations stay float unless accuracy_level 4."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    cfg = DefaultWeightOnlyQuantConfig(block_size=recipe.block_size, is_symmetric=True,
                                       accuracy_level=recipe.accuracy_level, bits=8)
    q = MatMulNBitsQuantizer(onnx.load(str(src)), block_size=recipe.block_size, is_symmetric=True,
                             accuracy_level=recipe.accuracy_level, nodes_to_exclude=excluded,
                             op_types_to_quantize=("MatMul",), algo_config=cfg)
    q.process()
    q.model.save_model_to_file(str(dst), use_external_data_format=False)


def to_int8(src: Path, dst: Path, recipe: Int8Recipe) -> dict:
    """Dynamic INT8 quantisation (weights int8, activations quantised at run time) per the recipe."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for name in ("onnxruntime.quantization.matmul_nbits_quantizer",):
        logging.getLogger(name).setLevel(logging.WARNING)
    excluded = exclusions(onnx.load(str(src), load_external_data=False), recipe)
    try:
        if recipe.method == "nbits":
            _weight_only(src, dst, recipe, excluded)
            return {**asdict(recipe), "excluded_nodes": len(excluded)}
        quantize_dynamic(str(src), str(dst), op_types_to_quantize=list(recipe.op_types), per_channel=recipe.per_channel,
                         reduce_range=recipe.reduce_range, weight_type=QuantType.QInt8, nodes_to_exclude=excluded,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT, **recipe.extra})
    except (RuntimeError, ValueError) as err:
        raise ExportError(f"INT8 quantisation ({recipe.name}) failed on {src}: {err}") from err
    m = onnx.load(str(dst))
    m.ir_version = min(m.ir_version, MAX_IR_VERSION)
    onnx.save(m, str(dst))
    info = asdict(recipe)
    info["excluded_nodes"] = len(excluded)
    return info


def convert(fp32: Path, work: Path, source: ModelSource, precision: str, recipe: str = DEFAULT_RECIPE
            ) -> tuple[Path, Path, dict]:
    """fp32 graph -> fused graph in the target precision; returns its path, the fused fp32 graph, and what was done.

    The returned graph is one self-contained file; the fused fp32 graph of fp16/int8 keeps its weights in .data.
    """
    use_gpu = precision == "fp16"
    fused = work / f"fused_{'gpu' if use_gpu else 'cpu'}.onnx"
    info: dict = {"fusion": fuse(fp32, fused, source, use_gpu=use_gpu, external_data=precision != "fp32")}
    if precision == "fp32":
        return fused, fused, info
    if precision == "fp16":
        out = work / "embedding_fp16.onnx"
        to_fp16(fused, out)
        info["fp16"] = {"keep_io_types": True}
        return out, fused, info
    if recipe not in RECIPES:
        raise ExportError(f"INT8 recipe {recipe!r} is unknown; use one of {sorted(RECIPES)}.")
    out = work / f"embedding_int8_{recipe}.onnx"
    info["int8"] = to_int8(fused, out, RECIPES[recipe])
    return out, fused, info

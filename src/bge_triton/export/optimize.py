"""ONNX Runtime transformer fusion, then FP16 (GPU, float32 I/O) or INT8 (CPU) conversion of the embedding graph."""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from bge_triton.errors import ExportError

from .onnx_export import MAX_IR_VERSION, save_external
from .recipes import DEFAULT_RECIPE, RECIPES, Int8Recipe
from .source import ModelSource

__all__ = ["DEFAULT_RECIPE", "RECIPES", "Int8Recipe", "convert", "fuse", "to_fp16", "to_int8"]


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
        raise ExportError(f"ONNX Runtime fusion failed for {src} (heads {source.heads}, hidden {source.hidden}): "
                          f"{err}") from err
    stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}
    opt.model.ir_version = min(opt.model.ir_version, MAX_IR_VERSION)
    # the fused contrib ops (Attention, SkipLayerNormalization...) need their domain declared: ONNX Runtime
    # tolerates its absence, but onnx's shape inference (quantize_dynamic) and checker do not
    domains = {o.domain for o in opt.model.opset_import}
    if "com.microsoft" not in domains and any(n.domain == "com.microsoft" for n in opt.model.graph.node):
        opt.model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
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


def _qdq_weight_only(src: Path, dst: Path, excluded: list[str]) -> int:
    """Int8 weights per output channel (symmetric, zero point 0) with a DequantizeLinear before each MatMul.

    Activations and arithmetic stay float: the vectors move by the weights' rounding only (the INT8 gate holds),
    and the graph uses standard ONNX ops (opset >= 13) that ONNX Runtime 1.19.2, the 24.10 server image's, runs.
    The scale is ONNX Runtime's symmetric int8 one (quant_utils.compute_scale_zp: max |w| / 127 per channel).
    """
    from onnxruntime.quantization.quant_utils import compute_scale_zp

    qmin, qmax = np.array(-127, np.int8), np.array(127, np.int8)
    model = onnx.load(str(src))
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    done, new_nodes = 0, []
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or node.name in excluded or w.data_type != onnx.TensorProto.FLOAT or len(w.dims) != 2:
            new_nodes.append(node)
            continue
        arr = numpy_helper.to_array(w)
        absmax = np.abs(arr).max(axis=0)
        scales = np.array([compute_scale_zp(-m, m, qmin, qmax, symmetric=True)[1] for m in absmax], np.float32)
        q = np.clip(np.rint(arr / scales), -127, 127).astype(np.int8)
        base = f"{w.name}_qdq8"
        g.initializer.extend([numpy_helper.from_array(q, base + "_q"), numpy_helper.from_array(scales, base + "_scale"),
                              numpy_helper.from_array(np.zeros_like(scales, dtype=np.int8), base + "_zp")])
        new_nodes.append(helper.make_node("DequantizeLinear", [base + "_q", base + "_scale", base + "_zp"],
                                          [base + "_deq"], axis=1, name=f"{node.name}_dequant_weight"))
        node.input[1] = base + "_deq"
        new_nodes.append(node)
        uses[w.name] -= 1
        done += 1
    unused = [t for t in g.initializer if uses.get(t.name, 1) == 0 and t.name in inits]
    for t in unused:
        g.initializer.remove(t)
    del g.node[:]
    g.node.extend(new_nodes)
    if max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0) < 13:
        raise ExportError(f"{src}: per-channel DequantizeLinear needs opset >= 13; export with --opset 17.")
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, str(dst))
    return done


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
        if recipe.method == "qdq":
            quantized = _qdq_weight_only(src, dst, excluded)
            return {**asdict(recipe), "excluded_nodes": len(excluded), "quantized_matmuls": quantized}
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

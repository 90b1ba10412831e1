"""PyTorch encoder -> ONNX with optimum's exporter, then CLS/mean pooling and L2 normalisation added to the graph.

The served graph takes input_ids + attention_mask (int64, dynamic batch and sequence) and returns
`embedding` [batch, dim] float32: one unit vector per text instead of L x dim hidden states on the wire.
token_type_ids is not an input: BGE's are all zero, and BertModel falls back to its zero buffer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bge_triton.errors import ExportError

from .source import ModelSource

INPUTS = ("input_ids", "attention_mask")
HIDDEN = "last_hidden_state"
OUTPUT = "embedding"
MAX_IR_VERSION = 10  # ONNX Runtime 1.19 (Triton 24.10) reads IR <= 10
L2_EPS = 1e-12  # torch.nn.functional.normalize's eps
MEAN_EPS = 1e-9  # sentence-transformers' clamp of the token count


def _encoder_onnx_config(model_config):
    """optimum's BERT ONNX config narrowed to the two inputs the server sends."""
    from optimum.exporters.onnx.model_configs import BertOnnxConfig

    class EncoderOnnxConfig(BertOnnxConfig):
        """BERT feature extraction without token_type_ids (all zero for BGE; folded into the graph)."""

        @property
        def inputs(self) -> dict[str, dict[int, str]]:
            axes = {0: "batch_size", 1: "sequence_length"}
            return {name: dict(axes) for name in INPUTS}

    return EncoderOnnxConfig(model_config, task="feature-extraction")


def export_encoder(model, out: Path, opset: int) -> Path:
    """Export the encoder's last_hidden_state with optimum.exporters.onnx.export."""
    from optimum.exporters.onnx import export

    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = _encoder_onnx_config(model.config)
    try:  # no dynamic-axes fix: it opens an ONNX Runtime session on the whole graph (a second copy of the weights)
        # to rename output axes, and add_pooling replaces the outputs with its own [batch_size, hidden] anyway
        export(model=model, config=cfg, output=out, opset=opset, device="cpu", disable_dynamic_axes_fix=True)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ExportError(f"optimum could not export the encoder at opset {opset}: {err}. Try --opset 17.") from err
    return out


def _const(name: str, value, dtype=np.int64) -> onnx.TensorProto:
    """An initializer tensor."""
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def pooling_nodes(pooling: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes that turn last_hidden_state [B, L, H] into L2-normalised `embedding` [B, H] (opset >= 13 forms)."""
    nodes: list[onnx.NodeProto] = []
    inits = [_const("pool_axis1", [1]), _const("pool_axis_last", [-1]),
             _const("pool_l2_eps", L2_EPS, np.float32)]
    if pooling == "cls":
        inits.append(_const("pool_zero", 0))
        nodes.append(helper.make_node("Gather", [HIDDEN, "pool_zero"], ["pooled"], axis=1, name="pool_cls"))
    elif pooling == "mean":
        inits.append(_const("pool_count_eps", MEAN_EPS, np.float32))
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["pool_mask_f"], to=TensorProto.FLOAT, name="pool_mask_cast"),
            helper.make_node("Unsqueeze", ["pool_mask_f", "pool_axis_last"], ["pool_mask3"], name="pool_mask_unsq"),
            helper.make_node("Mul", [HIDDEN, "pool_mask3"], ["pool_masked"], name="pool_mask_mul"),
            helper.make_node("ReduceSum", ["pool_masked", "pool_axis1"], ["pool_sum"], keepdims=0, name="pool_sum"),
            helper.make_node("ReduceSum", ["pool_mask3", "pool_axis1"], ["pool_count"], keepdims=0, name="pool_count"),
            helper.make_node("Max", ["pool_count", "pool_count_eps"], ["pool_count_c"], name="pool_count_clamp"),
            helper.make_node("Div", ["pool_sum", "pool_count_c"], ["pooled"], name="pool_mean"),
        ]
    else:
        raise ExportError(f"pooling {pooling!r} is not supported; use cls or mean.")
    nodes += [  # x / max(||x||, eps); Mul+ReduceSum+Sqrt keeps one form for every opset 14..21
        helper.make_node("Mul", ["pooled", "pooled"], ["l2_sq"], name="l2_sq"),
        helper.make_node("ReduceSum", ["l2_sq", "pool_axis1"], ["l2_sumsq"], keepdims=1, name="l2_sumsq"),
        helper.make_node("Sqrt", ["l2_sumsq"], ["l2_norm"], name="l2_norm"),
        helper.make_node("Max", ["l2_norm", "pool_l2_eps"], ["l2_norm_c"], name="l2_clamp"),
        helper.make_node("Div", ["pooled", "l2_norm_c"], [OUTPUT], name="l2_div"),
    ]
    return nodes, inits


def add_pooling(encoder: onnx.ModelProto, pooling: str, hidden: int) -> onnx.ModelProto:
    """Append pooling + L2 normalisation so the graph's one output is `embedding` [batch_size, hidden] float32."""
    g = encoder.graph
    names = [i.name for i in g.input]
    if names != list(INPUTS):
        raise ExportError(f"exported encoder has inputs {names}, expected {list(INPUTS)}; the model's forward() "
                          f"signature is not BERT-like.")
    if HIDDEN not in [o.name for o in g.output]:
        raise ExportError(f"exported encoder has no {HIDDEN} output ({[o.name for o in g.output]}).")
    nodes, inits = pooling_nodes(pooling)
    g.node.extend(nodes)
    g.initializer.extend(inits)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch_size", hidden]))
    encoder.ir_version = min(encoder.ir_version, MAX_IR_VERSION)
    return encoder


def save_external(model: onnx.ModelProto, path: Path) -> Path:
    """Save with the weights in PATH.data: no serialised copy of the weights in memory, and later loads can skip
    them."""
    for old in (path, path.with_name(path.name + ".data")):
        old.unlink(missing_ok=True)  # external data is appended to an existing file
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    return path


def export_embedding_model(model, source: ModelSource, work: Path, opset: int) -> Path:
    """Full fp32 graph with pooling in it, written to work/embedding_fp32.onnx (+ .data) and checked from the file."""
    encoder_path = export_encoder(model, work / "encoder.onnx", opset)
    full = add_pooling(onnx.load(str(encoder_path)), source.pooling, source.hidden)
    out = save_external(full, work / "embedding_fp32.onnx")
    del full
    for f in work.glob("encoder.onnx*"):
        f.unlink()
    onnx.checker.check_model(str(out))  # by path: the checker reads the graph, not a second copy of the weights
    return out


def describe_io(path: Path) -> dict:
    """Graph inputs/outputs with dtypes and shapes, and the default-domain opset (report and tests)."""
    m = onnx.load(str(path), load_external_data=False)

    def dims(v) -> list:
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    def dtype(v) -> str:
        return TensorProto.DataType.Name(v.type.tensor_type.elem_type)

    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    return {
        "inputs": {v.name: {"dtype": dtype(v), "shape": dims(v)} for v in m.graph.input},
        "outputs": {v.name: {"dtype": dtype(v), "shape": dims(v)} for v in m.graph.output},
        "opset": opset, "ir_version": m.ir_version,
        "op_types": sorted({n.op_type for n in m.graph.node}),
    }

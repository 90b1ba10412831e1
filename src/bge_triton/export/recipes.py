"""The INT8 recipes: which quantisation, which ops, and the oldest ONNX Runtime that runs the graph it writes.

A table of data with no imports from the rest of the exporter, so settings (flag checks) and optimize (the
quantisation itself) both read it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The ONNX Runtime of the default server image, nvcr.io/nvidia/tritonserver:24.10-py3 (Triton 2.51).
SERVER_IMAGE_ORT = "1.19.2"
# 8-bit MatMulNBits: ONNX Runtime 1.19.2 refuses it ("Only 4b quantization is supported for MatMulNBits op");
# refused by 1.19.2, 1.20.1 and 1.21.1, run by 1.22.1 (an nbits8 export loaded in each, its own venv; docs/export.md).
NBITS8_MIN_ORT = "1.22.0"


@dataclass(frozen=True)
class Int8Recipe:
    """An INT8 quantisation recipe: which ops, per-channel or not, which nodes stay float, and where it runs."""

    name: str
    method: str = "dynamic"  # dynamic: quantize_dynamic; nbits: MatMulNBits; qdq: int8 weights + DequantizeLinear
    op_types: tuple[str, ...] = ("MatMul", "Attention", "Gather")
    per_channel: bool = False
    reduce_range: bool = False
    exclude: tuple[str, ...] = ()  # node-name patterns: "ffn_out" = each layer's FFN output projection
    extra: dict = field(default_factory=dict)
    block_size: int = 32  # nbits only: weights per quantisation block
    accuracy_level: int | None = None  # nbits only: 4 = int8 compute (activations quantised per block)
    min_ort: str = "1.16.0"  # the oldest ONNX Runtime that loads the graph

    def runs_on(self, ort_version: str) -> bool:
        """True when ONNX Runtime `ort_version` loads this recipe's graph."""
        return version_tuple(ort_version) >= version_tuple(self.min_ort)


def version_tuple(version: str) -> tuple[int, ...]:
    """'1.19.2' -> (1, 19, 2); a suffix such as '+cu12' or 'rc1' is ignored."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# Measured on all-MiniLM-L6-v2 against its FP32 graph (reports/export/fidelity.md): the quantize_dynamic recipes
# (per-tensor activation scales) miss the top-10 bar; weight-only int8 holds every bar. `qdq8` (per-channel
# int8 weights, DequantizeLinear before each MatMul, float compute) runs in the 24.10 server image's ONNX Runtime
# 1.19.2 but is no faster than FP32 on a CPU (it dequantises the weights at every call:
# reports/export/int8_recipes/bench.md); `nbits8` (8-bit blockwise MatMulNBits with int8 compute) is the fast one
# and needs ONNX Runtime >= NBITS8_MIN_ORT. `auto` picks per --server-onnxruntime.
RECIPES: dict[str, Int8Recipe] = {
    "qdq8": Int8Recipe("qdq8", method="qdq", op_types=("MatMul",), per_channel=True, min_ort="1.13.0"),
    "plain": Int8Recipe("plain"),
    "per-channel": Int8Recipe("per-channel", per_channel=True),
    "matmul-pc": Int8Recipe("matmul-pc", op_types=("MatMul",), per_channel=True),
    "matmul-pc-ffn-float": Int8Recipe("matmul-pc-ffn-float", op_types=("MatMul",), per_channel=True,
                                      exclude=("ffn_out",)),
    "nbits8-weight-only": Int8Recipe("nbits8-weight-only", method="nbits", block_size=32, min_ort=NBITS8_MIN_ORT),
    "nbits8": Int8Recipe("nbits8", method="nbits", block_size=32, accuracy_level=4, min_ort=NBITS8_MIN_ORT),
    "nbits8-b128": Int8Recipe("nbits8-b128", method="nbits", block_size=128, accuracy_level=4,
                              min_ort=NBITS8_MIN_ORT),
}
DEFAULT_RECIPE = "qdq8"  # runs in every server ONNX Runtime the kit targets
FAST_RECIPE = "nbits8"  # int8 compute on a CPU, where the server's ONNX Runtime runs it
AUTO = "auto"  # --int8-recipe's default: FAST_RECIPE when the server runs it, else DEFAULT_RECIPE
LOCAL = "local"  # --server-onnxruntime local: this kit's own onnxruntime (the local CPU server)


def pick_recipe(server_ort: str) -> str:
    """The recipe `auto` means for a server running ONNX Runtime `server_ort`."""
    return FAST_RECIPE if RECIPES[FAST_RECIPE].runs_on(server_ort) else DEFAULT_RECIPE

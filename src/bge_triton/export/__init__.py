"""Export stage: HF model -> ONNX (optimum) -> pooling + L2 in-graph -> ORT fusion -> FP16/INT8 -> validated ->
repository, with the reference vectors `bge-triton verify` checks.

Entry points: `bge-triton export`, `python -m bge_triton.export.bench`,
`python -m bge_triton.export.fidelity_report`, `python -m bge_triton.export.compat`.
"""
from __future__ import annotations

from bge_triton.extras import require

require("export", "bge_triton.export (HF -> ONNX)")


__all__ = ["ExportSettings", "run_export"]


def __getattr__(name: str):
    """Import the heavy pipeline (torch, optimum) only when used."""
    if name == "ExportSettings":
        from .settings import ExportSettings

        return ExportSettings
    if name == "run_export":
        from .pipeline import run_export

        return run_export
    raise AttributeError(name)

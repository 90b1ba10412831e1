"""Export stage: HF model -> ONNX (optimum) -> pooling + L2 in-graph -> ORT fusion -> FP16/INT8 -> validated -> repository.

Entry points: `python -m export`, `python -m export.bench`, `python -m export.fidelity_report`.
"""
from __future__ import annotations

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

"""What every export run records, embedder or reranker: its result, the command that regenerates it, the library
versions it ran with, and the memory it held between stages (export.pipeline and export.rerank_pipeline)."""
from __future__ import annotations

import ctypes
import gc
import platform
import resource
from dataclasses import dataclass
from pathlib import Path

from .recipes import SERVER_IMAGE_ORT
from .settings import ExportSettings
from .validate import Fidelity


@dataclass
class ExportResult:
    """What one export produced: the report (also on disk), the files, and the fidelity verdict."""

    report: dict
    paths: dict[str, Path]
    fidelity: Fidelity


def command_line(s: ExportSettings) -> str:
    """The command that regenerates this export, embedder or reranker (written into generated files)."""
    parts = ["bge-triton export", f"--model-id {s.model}", f"--repository {s.repository}", f"--model {s.name}",
             f"--precision {s.precision}"]
    if s.task:
        parts.append(f"--task {s.task}")
    if s.max_length:
        parts.append(f"--max-length {s.max_length}")
    if s.pooling:
        parts.append(f"--pooling {s.pooling}")
    if s.precision == "int8":
        parts.append(f"--int8-recipe {s.int8_recipe}")
    if s.server_onnxruntime != SERVER_IMAGE_ORT:
        parts.append(f"--server-onnxruntime {s.server_onnxruntime}")
    if s.seed:
        parts.append(f"--seed {s.seed}")
    if s.retrieval_queries is not None:
        parts.append(f"--retrieval-queries {s.retrieval_queries}")
    if s.retrieval_corpus is not None:
        parts.append(f"--retrieval-corpus {s.retrieval_corpus}")
    return " ".join(parts)


def versions() -> dict[str, str]:
    """Library versions the export ran with (numbers depend on them)."""
    import onnx
    import onnxruntime
    import optimum.version
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "optimum": optimum.version.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise), between stages."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): the pages stay with the process
        pass

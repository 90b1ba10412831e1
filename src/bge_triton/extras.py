"""Which optional extra a subpackage needs, and the ImportError that names it (Infinity's habit)."""
from __future__ import annotations

import importlib.util

EXTRAS = {
    "export": ("torch", "optimum", "onnx", "onnxruntime", "transformers"),
    "server": ("pytriton", "onnxruntime", "psutil"),
    "loadtest": ("locust", "matplotlib", "snownlp", "psutil"),
    "gateway": ("starlette", "uvicorn", "orjson", "prometheus_client", "pydantic"),
    "langchain": ("langchain_core",),
    "llamaindex": ("llama_index",),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (without importing them)."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise ImportError naming the extra to install when a module of `extra` is missing."""
    absent = missing(extra)
    if absent:
        raise ImportError(
            f"{what} needs {', '.join(absent)}, which the SDK-only install does not carry: "
            f"pip install 'bge-triton-kit[{extra}]' (or [all])")

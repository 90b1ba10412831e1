"""Build (and cache) unvalidated graph variants of one model for benchmarks and the fidelity report."""
from __future__ import annotations

from pathlib import Path

from .onnx_export import export_embedding_model
from .optimize import convert
from .settings import ExportSettings
from .source import ModelSource, inspect_model, load_torch_model


class VariantBuilder:
    """Exports a model's fp32 graph once, then fp32/fp16/int8-recipe variants on demand, cached on disk."""

    def __init__(self, model: str, cache_dir: Path, seed: int = 0, max_length: int | None = None) -> None:
        self.settings = ExportSettings(model=model, repository=cache_dir / "unused", name="bench", seed=seed,
                                       cache_dir=cache_dir, max_length=max_length, quiet=True).check()
        self.source: ModelSource = inspect_model(self.settings)
        slug = model.replace(":", "_").replace("/", "_")
        self.work = cache_dir / "variants" / f"{slug}-seed{seed}"
        self._model = None

    @property
    def torch_model(self):
        """The PyTorch encoder, loaded on first use."""
        if self._model is None:
            self._model = load_torch_model(self.source)
        return self._model

    def fp32_graph(self) -> Path:
        """The unfused fp32 graph with pooling (the reference graph)."""
        path = self.work / "embedding_fp32.onnx"
        if not path.is_file():
            export_embedding_model(self.torch_model, self.source, self.work, self.settings.opset)
        return path

    def variant(self, precision: str, recipe: str = "nbits8") -> Path:
        """A fused graph in `precision` (int8: with `recipe`), built once."""
        label = precision if precision != "int8" else f"int8-{recipe}"
        final = self.work / f"{label}.onnx"
        if final.is_file():
            return final
        tmp = self.work / f"tmp-{label}"
        tmp.mkdir(parents=True, exist_ok=True)
        graph, _, _ = convert(self.fp32_graph(), tmp, self.source, precision, recipe)
        graph.replace(final)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        return final


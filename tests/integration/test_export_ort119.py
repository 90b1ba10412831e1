"""Every precision the exporter writes loads in the 24.10 server image's ONNX Runtime (1.19.2) and gives the
vectors of the exporter's own ONNX Runtime (min cosine >= 0.9999 on the export's reference probes).

1.19.2 runs in its own venv (`onnxruntime==1.19.2`, `numpy<2`), built once under .kit/venvs and reused.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from bge_triton.errors import ExportError
from bge_triton.export.compat import compare, ensure_venv, run_in
from bge_triton.export.recipes import SERVER_IMAGE_ORT
from conftest import MINILM, REPO_ROOT, run_export

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ort119() -> Path:
    return ensure_venv(SERVER_IMAGE_ORT, REPO_ROOT / ".kit" / "venvs")


@pytest.fixture(scope="module")
def exports(minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 (the session's export), fp16 and int8 with the exporter's defaults (int8: a smaller neighbour sample,
    still enforced: the fidelity gate itself is tests/integration/test_export_minilm.py's)."""
    out = {"fp32": minilm_repo}
    for precision, extra in (("fp16", ()), ("int8", ("--retrieval-queries", "20", "--retrieval-corpus", "200"))):
        repo = tmp_path_factory.mktemp(f"ort119_{precision}")
        run_export(repo, "minilm", MINILM, precision, *extra)
        out[precision] = repo
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_every_precision_runs_in_the_server_images_onnxruntime(precision: str, exports: dict[str, Path],
                                                               ort119: Path) -> None:
    version, rows = compare(exports[precision], "minilm", ort119)
    assert version == SERVER_IMAGE_ORT
    assert len(rows) >= 10 and {r.precision for r in rows} == {precision}
    worst = min(rows, key=lambda r: r.other_vs_here)
    assert worst.other_vs_here >= 0.9999, worst
    bar = 0.98 if precision == "int8" else 0.999  # and both runtimes hold the verify tolerance against PyTorch
    assert min(r.other_vs_reference for r in rows) >= bar


def test_the_old_int8_graph_is_what_1_19_2_refuses(exports: dict[str, Path], ort119: Path, tmp_path: Path) -> None:
    """The venv really is 1.19.2: the 8-bit MatMulNBits graph the exporter wrote before (recipe nbits8, now
    refused for this server) fails there with ONNX Runtime's own message."""
    from bge_triton.export.variants import VariantBuilder

    graph = VariantBuilder(MINILM, tmp_path / "cache").variant("int8", "nbits8")
    with pytest.raises(ExportError, match="Only 4b quantization is supported"):
        run_in(ort119, graph, [[101, 102]])

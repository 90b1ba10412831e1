"""The compose `exporter` service: export the model into the repository unless a validated export is there.

    python3 deploy/prepare_model.py --model BAAI/bge-large-zh-v1.5 --repository /kit/model_repository --name bge_large_zh \
        --precision fp16

A validated export is what `python -m bge_triton.export` writes only after validation passed: NAME_onnx/1/
export_report.json with fidelity.passed, for this --model and --precision, beside the model.onnx whose sha256
it records, and NAME/1/tokenizer/tokenizer.json. Anything else runs the exporter (after fetching a hub id into
the Hugging Face cache: the GPU host has the network that the exporter itself never uses).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence


def export_problem(repository: Path, name: str, model: str, precision: str) -> str | None:
    """Why the repository lacks a validated export of `model` at `precision` (None: it has one)."""
    from bge_triton.export.writer import model_paths, sha256

    paths = model_paths(repository, name)
    if not paths["report"].is_file():
        return f"no {paths['report']}"
    try:
        report = json.loads(paths["report"].read_text(encoding="utf-8"))
    except ValueError as exc:
        return f"{paths['report']} is not JSON ({exc})"
    if not report.get("fidelity", {}).get("passed"):
        return f"{paths['report']} does not record a passed validation"
    if report.get("precision") != precision:
        return f"the export is {report.get('precision')}, the deployment wants {precision}"
    if report.get("model") != model:
        return f"the export is of {report.get('model')!r}, the deployment wants {model!r}"
    if not (paths["tokenizer"] / "tokenizer.json").is_file():
        return f"no {paths['tokenizer'] / 'tokenizer.json'}"
    if not paths["onnx"].is_file():
        return f"no {paths['onnx']}"
    if sha256(paths["onnx"]) != report.get("onnx_sha256"):
        return f"{paths['onnx']} is not the file its report validated (sha256 differs)"
    return None


def fetch_hub_model(model: str) -> None:
    """Download a hub id into the Hugging Face cache (HF_HOME) unless it is a path, synthetic, or cached."""
    if model.startswith(("synthetic:", "/", ".", "~")) or Path(model).exists() or model.count("/") != 1:
        return
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(model, local_files_only=True)
    except Exception:  # huggingface_hub raises several types for "not cached"; fetch it then
        print(f"prepare_model: downloading {model} into the Hugging Face cache", flush=True)
        snapshot_download(model)


def main(argv: Sequence[str] | None = None) -> int:
    """Skip (0) when the export is valid; otherwise fetch and export, returning the exporter's status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--repository", required=True, type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--precision", required=True)
    a, rest = p.parse_known_args(argv)
    problem = export_problem(a.repository, a.name, a.model, a.precision)
    if problem is None:
        print(f"prepare_model: {a.repository} holds a validated {a.precision} export of {a.model}: skipping the export")
        return 0
    print(f"prepare_model: exporting {a.model} ({a.precision}): {problem}", flush=True)
    fetch_hub_model(a.model)
    from bge_triton.export.__main__ import main as export_main

    return export_main(["--model", a.model, "--repository", str(a.repository), "--name", a.name,
                        "--precision", a.precision, *rest])


if __name__ == "__main__":
    sys.exit(main())

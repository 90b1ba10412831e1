"""A deployment's start-up export: skip when the repository already holds a validated export (--skip-existing),
and put the written configs on the device the deployment has (--instance-kind)."""
from __future__ import annotations

import json
from pathlib import Path

from .writer import model_paths, sha256


def export_problem(repository: Path, name: str, model_id: str, precision: str) -> str | None:
    """Why `repository` lacks a validated export of `model_id` at `precision` as NAME (None: it has one).

    Validated means what the exporter writes only after validation passed: NAME_onnx/1/export_report.json with
    fidelity.passed for this model and precision, beside the model.onnx whose sha256 it records, and the text
    endpoint's tokenizer."""
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
        return f"the export is {report.get('precision')}, --precision asks for {precision}"
    if report.get("model") != model_id:
        return f"the export is of {report.get('model')!r}, --model-id asks for {model_id!r}"
    if not (paths["tokenizer"] / "tokenizer.json").is_file():
        return f"no {paths['tokenizer'] / 'tokenizer.json'}"
    if not paths["onnx"].is_file():
        return f"no {paths['onnx']}"
    if sha256(paths["onnx"]) != report.get("onnx_sha256"):
        return f"{paths['onnx']} is not the file its report validated (sha256 differs)"
    return None


def set_instance_kind(repository: Path, kind: str) -> list[str]:
    """Put the repository's models on `kind` ("cpu": every KIND_GPU group -> KIND_CPU; "gpu": the ONNX Runtime
    models' KIND_CPU groups -> KIND_GPU, as the canonical configs have them). Returns the models rewritten."""
    from tritonclient.grpc import model_config_pb2 as mc

    from bge_triton.repository import iter_models, load_config, write_config

    want = mc.ModelInstanceGroup.KIND_CPU if kind == "cpu" else mc.ModelInstanceGroup.KIND_GPU
    changed = []
    for name, model_dir in iter_models(repository):
        cfg = load_config(model_dir)
        if kind == "gpu" and not (cfg.backend == "onnxruntime" or cfg.platform == "onnxruntime_onnx"):
            continue
        groups = [g for g in cfg.instance_group if g.kind != want and g.kind in
                  (mc.ModelInstanceGroup.KIND_CPU, mc.ModelInstanceGroup.KIND_GPU)]
        if not groups:
            continue
        for group in groups:
            group.kind = want
            del group.gpus[:]
        write_config(cfg, model_dir / "config.pbtxt", f"bge-triton export --instance-kind {kind} (after the export)")
        changed.append(name)
    return changed

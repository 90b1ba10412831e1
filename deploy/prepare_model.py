"""The compose `exporter` service: export the model into the repository unless a validated export is there.

    python3 deploy/prepare_model.py --model BAAI/bge-large-zh-v1.5 --repository /models --name bge_large_zh \
        --precision fp16 --instance-kind gpu

    # no GPU (docker-compose.cpu.yml): the same, with every instance group on KIND_CPU
    python3 deploy/prepare_model.py ... --precision fp32 --instance-kind cpu

A validated export is what `python -m bge_triton.export` writes only after validation passed: NAME_onnx/1/
export_report.json with fidelity.passed, for this --model and --precision, beside the model.onnx whose sha256
it records, and NAME/1/tokenizer/tokenizer.json. Anything else runs the exporter (after fetching a hub id into
the Hugging Face cache: the GPU host has the network that the exporter itself never uses). Only the files the
export reads are fetched (HUB_FILES: safetensors weights, configs, tokenizer), not a repository's second copy of
the weights in PyTorch format; a repository without safetensors falls back to its pytorch_model*.bin.
--instance-kind then puts the written configs on the device the deployment has (the export writes the
canonical KIND_GPU encoder).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

# what the exporter reads from a hub repository (transformers' config + weights, the tokenizer, and the
# sentence-transformers pooling files); fnmatch patterns of huggingface_hub.snapshot_download
HUB_FILES = ["*.json", "*.safetensors", "vocab.txt", "*.model", "merges.txt", "*.tiktoken"]
HUB_FALLBACK_WEIGHTS = ["pytorch_model*.bin"]


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
    """Download a hub id's export files (HUB_FILES) into the Hugging Face cache (HF_HOME).

    Nothing for a path, a synthetic model, or a hub id already cached."""
    if model.startswith(("synthetic:", "/", ".", "~")) or Path(model).exists() or model.count("/") != 1:
        return
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(model, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # huggingface_hub raises several types for "not cached"; fetch it then
        print(f"prepare_model: downloading {model} ({', '.join(HUB_FILES)}) into the Hugging Face cache", flush=True)
        snapshot = Path(snapshot_download(model, allow_patterns=HUB_FILES))
    if not any(snapshot.rglob("*.safetensors")):
        print(f"prepare_model: {model} has no safetensors weights: downloading {HUB_FALLBACK_WEIGHTS}", flush=True)
        snapshot_download(model, allow_patterns=HUB_FALLBACK_WEIGHTS)


def set_instance_kind(repository: Path, kind: str) -> list[str]:
    """Put the repository's models on `kind` ("cpu": every KIND_GPU group -> KIND_CPU; "gpu": the onnxruntime
    models' KIND_CPU groups -> KIND_GPU, as the canonical configs have them). Returns the configs rewritten."""
    from tritonclient.grpc import model_config_pb2 as mc

    from bge_triton.server.repository import iter_models, load_config, write_config

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
        write_config(cfg, model_dir / "config.pbtxt",
                     f"deploy/prepare_model.py --instance-kind {kind} (after the export)")
        changed.append(name)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """Skip (0) when the export is valid; otherwise fetch and export, returning the exporter's status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--repository", required=True, type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--precision", required=True)
    p.add_argument("--instance-kind", choices=["gpu", "cpu"], default=None,
                   help="put the written configs on this device (default: as the export writes them, GPU)")
    a, rest = p.parse_known_args(argv)
    problem = export_problem(a.repository, a.name, a.model, a.precision)
    if problem is None:
        print(f"prepare_model: {a.repository} holds a validated {a.precision} export of {a.model}: skipping the export")
        status = 0
    else:
        print(f"prepare_model: exporting {a.model} ({a.precision}): {problem}", flush=True)
        fetch_hub_model(a.model)
        from bge_triton.export.__main__ import main as export_main

        status = export_main(["--model-id", a.model, "--repository", str(a.repository), "--model", a.name,
                              "--precision", a.precision, *rest])
    if status == 0 and a.instance_kind:
        for name in set_instance_kind(a.repository, a.instance_kind):
            print(f"prepare_model: {name} now runs on KIND_{a.instance_kind.upper()}")
    return status


if __name__ == "__main__":
    sys.exit(main())

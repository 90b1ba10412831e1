"""Write an export into the model repository: NAME_onnx/1/model.onnx + export_report.json, NAME/1/tokenizer/, configs."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from bge_triton.errors import ExportError

from .source import ModelSource

REPORT_FILE = "export_report.json"
ENCODER_SUFFIX = "_onnx"


def sha256(path: Path) -> str:
    """Hex digest of a file (the report pins exactly which model.onnx it describes)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_paths(repository: Path, name: str) -> dict[str, Path]:
    """Where each artefact of model NAME goes."""
    enc = repository / f"{name}{ENCODER_SUFFIX}" / "1"
    return {"onnx": enc / "model.onnx", "report": enc / REPORT_FILE, "tokenizer": repository / name / "1" / "tokenizer"}


def write_tokenizer(tokenizer, dst: Path, synthetic: bool) -> None:
    """Save the fast tokenizer files the text endpoint loads (tokenizer.json, vocab, configs)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    tokenizer.save_pretrained(str(dst))
    if synthetic:
        (dst / "SYNTHETIC").write_text("SYNTHETIC: generated vocab of a random-weight model (python -m bge_triton.export).\n")


def write_report(report: dict, dst: Path) -> None:
    """export_report.json; its first key says it is generated and by which command."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_configs(repository: Path, name: str, source: ModelSource, precision: str, command: str) -> tuple[Path, Path]:
    """Both config.pbtxt files, derived from the canonical ones through Triton's schema (server.repository)."""
    from bge_triton.server.repository import write_model_pair

    return write_model_pair(repository, name, source.hidden, source.max_length, synthetic=source.synthetic,
                            pooling=source.pooling, precision=precision, generated_by=command)


def write_all(repository: Path, name: str, graph: Path, tokenizer, source: ModelSource, precision: str,
              report: dict, command: str) -> dict[str, Path]:
    """Place every artefact; the report records the sha256 of the model.onnx written beside it."""
    if repository.exists() and not repository.is_dir():
        raise ExportError(f"--repository {repository} is a file, not a directory; pass a model repository folder.")
    paths = model_paths(repository, name)
    paths["onnx"].parent.mkdir(parents=True, exist_ok=True)
    for stale in paths["onnx"].parent.glob("model.onnx*"):  # old external-data files must not linger
        stale.unlink()
    shutil.copyfile(graph, paths["onnx"])
    write_tokenizer(tokenizer, paths["tokenizer"], source.synthetic)
    enc_cfg, txt_cfg = write_configs(repository, name, source, precision, command)
    paths.update({"encoder_config": enc_cfg, "text_config": txt_cfg})
    report["files"] = {k: str(v) for k, v in paths.items()}
    report["onnx_sha256"] = sha256(paths["onnx"])
    report["onnx_bytes"] = paths["onnx"].stat().st_size
    write_report(report, paths["report"])
    return paths

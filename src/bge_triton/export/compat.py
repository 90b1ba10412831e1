"""Exported graphs in the server image's ONNX Runtime: load each in that version (its own venv) and compare vectors.

The exporter fuses and quantises with the kit's ONNX Runtime; Triton 24.10 serves with 1.19.2. This command
installs `onnxruntime==VERSION` and `numpy<2` in a venv under .kit/venvs (once), runs the reference probes of each
export (NAME_onnx/1/reference.json, the exporter's tokens) through model.onnx there and here, and reports per probe
the cosine between the two runtimes and each runtime's cosine against the PyTorch FP32 reference.

    python -m bge_triton.export.compat --repository /tmp/r32 --repository /tmp/r16 --repository /tmp/r8 \
        --model minilm --onnxruntime 1.19.2 --out reports/export/ort_compat
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import venv
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bge_triton.errors import ExportError
from bge_triton.loadtest import report
from bge_triton.paths import STATE_DIR
from bge_triton.verify.standalone import ENCODER_SUFFIX, load_reference, reference_path

from .recipes import SERVER_IMAGE_ORT
from .validate import OnnxEmbedder

__all__ = ["ensure_venv", "run_in", "compare", "CompatRow"]

# Runs inside the other venv (onnxruntime + numpy only): JSON {"model", "ids": [[...], ...]} on stdin, each
# sequence alone; prints {"onnxruntime": version, "vectors": [[...], ...]}.
RUNNER = r"""
import json, sys
import numpy as np
import onnxruntime as ort
job = json.load(sys.stdin)
so = ort.SessionOptions()
so.log_severity_level = 3
s = ort.InferenceSession(job["model"], so, providers=["CPUExecutionProvider"])
out = []
for ids in job["ids"]:
    a = np.asarray([ids], dtype=np.int64)
    out.append(s.run(["embedding"], {"input_ids": a, "attention_mask": np.ones_like(a)})[0][0].tolist())
json.dump({"onnxruntime": ort.__version__, "vectors": out}, sys.stdout)
"""


def ensure_venv(version: str, root: Path | None = None) -> Path:
    """The python of a venv holding onnxruntime==VERSION and numpy<2, built once under ROOT (.kit/venvs)."""
    root = root or STATE_DIR / "venvs"
    home = root / f"onnxruntime-{version}-py{sys.version_info.major}{sys.version_info.minor}"
    python = home / "bin" / "python"
    done = home / ".complete"
    if done.is_file():
        return python
    venv.EnvBuilder(with_pip=True, clear=True).create(str(home))
    cmd = [str(python), "-m", "pip", "install", "--quiet", f"onnxruntime=={version}", "numpy<2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise ExportError(f"could not install onnxruntime=={version} into {home} ({' '.join(cmd[2:])}): "
                          f"{proc.stderr.strip()[-1500:]}")
    done.write_text(version + "\n")
    return python


def run_in(python: Path, model: Path, ids: list[list[int]]) -> tuple[str, np.ndarray]:
    """(onnxruntime version, vectors) of MODEL run by PYTHON's ONNX Runtime; ExportError with its error if it fails."""
    proc = subprocess.run([str(python), "-c", RUNNER], input=json.dumps({"model": str(model), "ids": ids}),
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        raise ExportError(f"{model} does not run in the ONNX Runtime of {python}: {lines[-1] if lines else '?'}")
    out = json.loads(proc.stdout)
    return out["onnxruntime"], np.asarray(out["vectors"], dtype=np.float32)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@dataclass
class CompatRow:
    """One probe of one export: both runtimes against each other and against the PyTorch FP32 reference."""

    export: str
    precision: str
    probe: str
    tokens: int
    other_vs_here: float  # cosine between the other ONNX Runtime and this one
    other_vs_reference: float
    here_vs_reference: float


def compare(repository: Path, model: str, python: Path) -> tuple[str, list[CompatRow]]:
    """Run MODEL's export in REPOSITORY in both runtimes on its reference probes; (other version, rows)."""
    ref = load_reference(reference_path(repository, model))
    graph = repository / f"{model}{ENCODER_SUFFIX}" / "1" / "model.onnx"
    ids = [p.input_ids for p in ref.probes]
    version, other = run_in(python, graph, ids)
    emb = OnnxEmbedder(graph)
    here = np.concatenate([emb({"input_ids": np.asarray([i], np.int64), "attention_mask": np.ones((1, len(i)),
                                                                                                   np.int64)})
                           for i in ids])
    vectors = np.stack([p.vector for p in ref.probes])
    a, b, c = _cos(other, here), _cos(other, vectors), _cos(here, vectors)
    return version, [CompatRow(ref.source, ref.precision, p.name, len(p.input_ids), float(x), float(y), float(z))
                     for p, x, y, z in zip(ref.probes, a, b, c, strict=True)]


def write_report(rows: list[CompatRow], version: str, here: str, out: Path, command: str) -> tuple[Path, Path]:
    """out.md (per precision: the worst probe of each column, then every probe) and out.csv."""
    out.parent.mkdir(parents=True, exist_ok=True)
    md, csv_path = out.with_suffix(".md"), out.with_suffix(".csv")
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    lines = [f"<!-- Generated by `{command}`; rerun it to regenerate. -->",
             f"# Exports in ONNX Runtime {version} (Triton 24.10's) against the exporter's {here}", "",
             *report.header(server=None, command=command), "Each probe of the export's "
             "reference.json alone, from the exporter's tokens, CPU execution provider in both runtimes. "
             "Cosines: between the two runtimes; each runtime against the PyTorch FP32 reference vectors.", "",
             f"| precision | probes | min cos {version} vs {here} | min cos {version} vs PyTorch | "
             f"min cos {here} vs PyTorch | worst probe |", "|---|---|---|---|---|---|"]
    for precision in dict.fromkeys(r.precision for r in rows):
        sel = [r for r in rows if r.precision == precision]
        worst = min(sel, key=lambda r: r.other_vs_reference)
        lines.append(f"| {precision} | {len(sel)} | {min(r.other_vs_here for r in sel):.7f} | "
                     f"{min(r.other_vs_reference for r in sel):.7f} | {min(r.here_vs_reference for r in sel):.7f} "
                     f"| {worst.probe} |")
    lines += ["", f"| precision | probe | tokens | {version} vs {here} | {version} vs PyTorch | {here} vs PyTorch |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r.precision} | {r.probe} | {r.tokens} | {r.other_vs_here:.7f} | {r.other_vs_reference:.7f} | "
              f"{r.here_vs_reference:.7f} |" for r in rows]
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md, csv_path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bge_triton.export.compat", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, action="append", required=True, help="an exported repository "
                   "(repeat: one per precision)")
    p.add_argument("--model", default="bge_large_zh", help="the export's name in each repository")
    p.add_argument("--onnxruntime", default=SERVER_IMAGE_ORT, help=f"the other version (default {SERVER_IMAGE_ORT})")
    p.add_argument("--venvs", type=Path, default=None, help="where the venv is built (default .kit/venvs)")
    p.add_argument("--min-cosine", type=float, default=0.9999, help="bar between the runtimes (default 0.9999)")
    p.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.csv")
    a = p.parse_args(argv)
    import onnxruntime

    try:
        python = ensure_venv(a.onnxruntime, a.venvs)
        rows: list[CompatRow] = []
        version = a.onnxruntime
        for repo in a.repository:
            version, got = compare(repo, a.model, python)
            rows += got
    except ExportError as err:
        print(f"compat failed: {err}", file=sys.stderr)
        return 1
    for r in rows:
        print(f"{r.precision:<5} {r.probe:<15} {r.other_vs_here:.7f} {r.other_vs_reference:.7f} "
              f"{r.here_vs_reference:.7f}")
    if a.out:
        cmd = "python -m bge_triton.export.compat " + " ".join(
            [f"--repository {r}" for r in a.repository] + [f"--model {a.model}", f"--onnxruntime {a.onnxruntime}",
                                                            f"--out {a.out}"])
        print("wrote", *write_report(rows, version, onnxruntime.__version__, a.out, cmd))
    worst = min(r.other_vs_here for r in rows)
    print(f"ONNX Runtime {version} vs {onnxruntime.__version__}: min cosine {worst:.7f} (bar {a.min_cosine})")
    return 0 if worst >= a.min_cosine else 1


if __name__ == "__main__":
    sys.exit(main())

"""`bge-triton export`: HF model -> validated ONNX in the model repository; prints a results table."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from bge_triton.errors import ExportError

from .pipeline import ExportResult, run_export
from .prepare import export_problem, set_instance_kind
from .settings import parse_settings


def results_table(result: ExportResult) -> str:
    """A markdown table of what was exported and how close it is to PyTorch; synthetic exports say SYNTHETIC."""
    r, f = result.report, result.fidelity
    if r.get("task") == "rerank":
        from .rerank_pipeline import rerank_table

        return rerank_table(result)
    skipped = f.not_run.get(f"top{f.topk or 10}_agreement")
    if f.topk_agreement is not None:
        topk = f"{f.topk_agreement:.3f} ({f.retrieval['queries']} queries / {f.retrieval['corpus']} texts" + (
            ", not enforced: synthetic)" if r["synthetic"] else ")")
    else:
        topk = skipped.split(";")[0] if skipped else "-"
    rows = [
        ("model", r["label"]), ("precision", r["precision"]), ("pooling", f"{r['pooling']} ({r['pooling_origin']})"),
        ("dim / max_length / opset", f"{r['dim']} / {r['max_length']} / {r['opset']}"),
        ("min cosine vs PyTorch", f"{f.min_cosine:.6f}"), ("mean cosine vs PyTorch", f"{f.mean_cosine:.6f}"),
        ("cosine of the two most alike texts (PyTorch)", f"{f.closest_texts_cosine:.6f}"),
        ("max abs diff", f"{f.max_abs_diff:.2e}"), ("batch vs single max abs", f"{f.batch_vs_single_max_abs:.2e}"),
        (f"top-{f.topk or 10} agreement vs fp32", topk), ("validation", "PASSED" if f.passed else "FAILED"),
        ("model.onnx", f"{r['files']['onnx']} ({r['onnx_bytes'] / 1e6:.1f} MB)"),
        ("time (s)", ", ".join(f"{k} {v}" for k, v in r["timings_s"].items())),
        ("peak RSS (MB) after", ", ".join(f"{k} {v}" for k, v in r["peak_rss_mb_after"].items())),
    ]
    head = "SYNTHETIC MODEL: random weights, for speed work only\n" if r["synthetic"] else ""
    return head + "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one export (or skip it: --skip-existing); 0 on success, 1 with the error on stderr otherwise."""
    try:
        settings = parse_settings(argv)
        problem = export_problem(settings.repository, settings.name, settings.model, settings.precision) \
            if settings.skip_existing else "--skip-existing not given"
        if problem is None:
            print(f"{settings.repository} holds a validated {settings.precision} export of {settings.model} as "
                  f"{settings.name}: skipping the export (--skip-existing)", flush=True)
        else:
            if settings.skip_existing:
                print(f"exporting {settings.model} ({settings.precision}): {problem}", flush=True)
            print(results_table(run_export(settings)), flush=True)
        if settings.instance_kind:
            for name in set_instance_kind(settings.repository, settings.instance_kind):
                print(f"{name} now runs on KIND_{settings.instance_kind.upper()} (--instance-kind)")
    except ExportError as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

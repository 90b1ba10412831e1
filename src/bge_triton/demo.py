"""`bge-triton demo`: the main job end to end on this machine.

Exports BAAI/bge-large-zh-v1.5 when it can be loaded offline (local dir or Hugging Face cache), otherwise
synthetic:bge-large-zh (random weights, said loudly); starts the real local tritonserver; embeds
Chinese sentences through the text endpoint with the client SDK; prints dims, norms, the
similarity matrix and Triton's batch statistics; stops the server by its pid.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bge_triton import flags
from bge_triton.errors import ExportError, KitError
from bge_triton.paths import STATE_DIR

REAL_MODEL = "BAAI/bge-large-zh-v1.5"
SYNTHETIC_MODEL = "synthetic:bge-large-zh"
SENTENCES = [
    "今天天气很好，我们去公园散步吧。",
    "今天阳光明媚，适合去公园走走。",
    "这家餐厅的菜太难吃了，服务也很差。",
    "向量检索是检索增强生成系统的第一步。",
    "Triton 的动态批处理可以提高 GPU 的吞吐量。",
]
BANNER = """
############################################################################
#  SYNTHETIC WEIGHTS: BAAI/bge-large-zh-v1.5 cannot be loaded here (no    #
#  local copy, no HF cache, no hub). The demo serves synthetic:bge-large-zh #
#  - the exact BERT-large architecture with RANDOM weights. Speed and the  #
#  serving path are real; the similarities below carry NO meaning.         #
############################################################################
"""


@dataclass(frozen=True)
class DemoSettings:
    """Flags of the demo command."""

    model: str | None
    precision: str
    repository: Path
    name: str
    http_port: int
    grpc_port: int
    metrics_port: int
    force_export: bool


def _parse(argv: list[str] | None) -> DemoSettings:
    p = flags.parser("bge-triton demo", (__doc__ or "").split("\n", 1)[1].strip())
    p.add_argument("--model-id", default=None, metavar="ID", help=f"the model to export: a hub id, a local "
                   f"directory or synthetic:... (default: {REAL_MODEL} if it is in the Hugging Face cache, "
                   f"else {SYNTHETIC_MODEL}; the demo never downloads)")
    flags.add_model(p, help="the served model's name (NAME_onnx is its encoder); a hub id, path or synthetic:... "
                    "given here (the older spelling) is read as --model-id", aliases=("--name",))
    flags.add_precision(p, default="int8", help="int8 is the CPU choice; fp16 is for a GPU")
    p.add_argument("--repository", type=Path, default=STATE_DIR / "demo" / "repository", metavar="DIR",
                   help="the model repository the demo exports into and serves")
    p.add_argument("--http-port", type=int, default=8000, help="the demo server's HTTP port")
    p.add_argument("--grpc-port", type=int, default=8001, help="the demo server's gRPC port")
    p.add_argument("--metrics-port", type=int, default=8002, help="the demo server's metrics port")
    p.add_argument("--force-export", action="store_true", help="export again even if the repository has it")
    a = flags.parse(p, argv)
    if a.model_id is None and not a.model.replace("_", "").replace("-", "").isalnum():
        a.model_id, a.model = a.model, flags.DEFAULT_MODEL  # `--model HUB_ID`, the older spelling
    return DemoSettings(a.model_id, a.precision, a.repository, a.model, a.http_port, a.grpc_port, a.metrics_port,
                        a.force_export)


def choose_model(requested: str | None) -> str:
    """The real BGE-Large-zh when it resolves offline, the synthetic one otherwise."""
    if requested:
        return requested
    from bge_triton.export.settings import ExportSettings
    from bge_triton.export.source import resolve_path

    try:
        resolve_path(ExportSettings(model=REAL_MODEL, repository=Path("."), name="probe", offline=True))
        return REAL_MODEL
    except ExportError:
        print(f"note: {REAL_MODEL} is neither a local directory nor in the Hugging Face cache, and the demo never "
              f"downloads; `bge-triton export --model-id {REAL_MODEL}` fetches it (HF_ENDPOINT for a mirror). "
              f"Serving {SYNTHETIC_MODEL} instead.", file=sys.stderr)
        return SYNTHETIC_MODEL


def ensure_export(s: DemoSettings, model: str) -> dict:
    """Run the exporter unless the repository already holds this model at this precision."""
    report_path = s.repository / f"{s.name}_onnx" / "1" / "export_report.json"
    if report_path.exists() and not s.force_export:
        report = json.loads(report_path.read_text())
        fresh = (report_path.parent / "reference.json").exists()  # exports before the verify probes lack it
        if report.get("model") == model and report.get("precision") == s.precision and fresh:
            print(f"reusing export in {s.repository} (--force-export to redo)")
            from bge_triton.repository import install_text_endpoint

            # this checkout's text endpoint, as the exporter writes it
            install_text_endpoint(s.repository / s.name / "1")
            return report
    from bge_triton.export.__main__ import main as export_main

    t0 = time.perf_counter()
    code = export_main(["--model-id", model, "--repository", str(s.repository), "--model", s.name,
                        "--precision", s.precision,
                        # served here by the kit's own ONNX Runtime: INT8 may use the faster nbits8 graph
                        "--server-onnxruntime", "local"])
    if code != 0:
        raise ExportError(f"export of {model} failed (exit {code}); see the table above")
    print(f"export took {time.perf_counter() - t0:.0f} s")
    return json.loads(report_path.read_text())


def show(vectors: np.ndarray, synthetic: bool) -> None:
    """Dims, norms and the cosine similarity matrix."""
    print(f"\nembeddings: shape {vectors.shape}, dtype {vectors.dtype}"
          + ("  [SYNTHETIC weights: similarities are meaningless]" if synthetic else ""))
    for text, vec in zip(SENTENCES, vectors, strict=False):
        print(f"  norm {np.linalg.norm(vec):.4f}  {text}")
    sim = vectors @ vectors.T
    print("\ncosine similarity:")
    print("      " + "".join(f"{j:>7d}" for j in range(len(SENTENCES))))
    for i, row in enumerate(sim):
        print(f"  {i:>3d} " + "".join(f"{v:7.3f}" for v in row))


def batch_stats(url: str, model: str) -> str:
    """How Triton batched the demo's requests, from its statistics extension (inference and execution counts).

    The python-backend models of the CPU stand-in report no per-size batch_stats, so the counts are the measure.
    """
    import tritonclient.grpc as grpcclient

    stats = grpcclient.InferenceServerClient(url).get_inference_statistics(model, as_json=True)
    entry = stats["model_stats"][0]
    inferences, executions = int(entry.get("inference_count", 0)), int(entry.get("execution_count", 0))
    line = f"{inferences} inferences in {executions} executions"
    sizes = sorted((int(r["batch_size"]), int(r["compute_infer"]["count"])) for r in entry.get("batch_stats", []))
    return line + (f", (batch size, executions) {sizes}" if sizes else "")


def encoder_mode(url: str, model: str) -> str:
    """The served text endpoint's `encoder` parameter (bls or inprocess), read from its model config."""
    import tritonclient.grpc as grpcclient

    params = grpcclient.InferenceServerClient(url).get_model_config(model).config.parameters
    return params["encoder"].string_value if "encoder" in params else "bls"


def main(argv: list[str] | None = None) -> int:
    """Export (or reuse), serve, embed, show, stop; 0 on success, 2 with the error on stderr."""
    s = _parse(argv)
    try:
        model = choose_model(s.model)
        synthetic = model.startswith("synthetic:")
        if synthetic:
            print(BANNER)
        report = ensure_export(s, model)
        from bge_triton.client import EmbeddingClient
        from bge_triton.server.launcher import LocalServer, ServerSettings

        settings = ServerSettings(repository=s.repository, http_port=s.http_port, grpc_port=s.grpc_port,
                                  metrics_port=s.metrics_port, state_dir=STATE_DIR / "demo" / "server")
        with LocalServer(settings) as srv:
            print(f"tritonserver pid {srv.pid} ready on {srv.grpc_url} (gRPC), {srv.http_url} (HTTP)")
            with EmbeddingClient(url=srv.grpc_url, model=s.name) as client:
                t0 = time.perf_counter()
                vectors = client.embed_documents(SENTENCES)
                print(f"embedded {len(SENTENCES)} sentences in {1000 * (time.perf_counter() - t0):.0f} ms "
                      f"({model}, {report.get('precision')}, pooling {report.get('pooling')})")
            show(vectors, synthetic)
            from bge_triton.verify import check

            verdict = check(srv.grpc_url, s.name, repository=s.repository, protocol="grpc")
            print(f"\nverify against the export's reference vectors: {verdict.message}")
            if not verdict.ok:
                raise KitError(f"the served model does not reproduce its export: {verdict.message}")
            print(f"\nTriton statistics {s.name}: {batch_stats(srv.grpc_url, s.name)}")
            print(f"Triton statistics {s.name}_onnx: {batch_stats(srv.grpc_url, f'{s.name}_onnx')}")
            if encoder_mode(srv.grpc_url, s.name) == "inprocess":
                print(f"(the CPU stand-in's text endpoint runs model.onnx in-process; {s.name}_onnx served only "
                      f"verify's encoder probes here; on the GPU the text endpoint calls it through BLS)")
        print("\nserver stopped." + ("  (SYNTHETIC weights were served)" if synthetic else ""))
        return 0
    except KitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

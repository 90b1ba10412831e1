"""`python -m bge_triton.loadtest.hop_latency`: where one text's latency goes, hop by hop, on the local Triton.

Medians for the same text, one request in flight, each path back to back in blocks that alternate
with raw ONNX Runtime in-process: the encoder model through Triton (gRPC + scheduler + python stub);
the text endpoint with its in-process encoder (the CPU variant's default); the text endpoint calling
the encoder by BLS.
Writes OUT/hops_spin_on.md (or _off). Same ONNX file, same intra-op threads and spin setting on both sides.

A second table isolates the Triton round trip itself: a no-op python model (gRPC + dynamic batcher +
python stub, no ONNX Runtime) answered at once, and the same model when its stub first computes for
`--busy-ms` (a busy loop, like an encoder run): the round trip beyond that busy time grows when every
other thread of the path has slept through it (their wake-ups and caches are cold).

A third table splits every path's mean by Triton's own statistics: time inside Triton (queue, compute
input / infer / output, as the server counts them) and outside it (gRPC frontend, loopback, client).
"""
from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bge_triton.loadtest.stats import fetch_stats
from bge_triton.server.cpu_variant import CPU_TEXT_PARAMS, CpuVariant
from bge_triton.server.launcher import REPO_ROOT, LocalServer, ServerSettings, free_ports
from bge_triton.server.repository import Batching

ENCODER_PATH = "encoder through Triton (gRPC + python stub)"
TEXT = "这家酒店的服务非常周到，房间也很干净，下次还来。"


@dataclass(frozen=True)
class HopSettings:
    """Flags of the command."""

    repository: Path
    name: str
    threads: int
    spin: bool
    n: int
    out: Path
    busy_ms: float = 8.0


def _parse(argv: list[str] | None) -> HopSettings:
    p = argparse.ArgumentParser(prog="python -m bge_triton.loadtest.hop_latency", description=__doc__)
    p.add_argument("--repository", type=Path, default=REPO_ROOT / ".kit" / "stack_bench" / "repo",
                   help="an exported repository (default: the stack bench's synthetic bge-small-zh)")
    p.add_argument("--name", default="bge_small_zh", help="model NAME (NAME + NAME_onnx)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads, both sides")
    p.add_argument("--no-spin", dest="spin", action="store_false",
                   help="ONNX Runtime spin-waiting off, both sides (default on inside runs, as the CPU variant)")
    p.add_argument("-n", type=int, default=60, help="timed calls per hop (after 5 warm-up calls)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "reports" / "stack")
    p.add_argument("--busy-ms", type=float, default=8.0,
                   help="the no-op model's busy time in the second table (default 8: about one encoder run here)")
    a = p.parse_args(argv)
    return HopSettings(a.repository, a.name, a.threads, a.spin, a.n, a.out, a.busy_ms)


NOOP_CONFIG = """name: "noop"
backend: "python"
max_batch_size: 8
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "embedding" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { }
"""

NOOP_MODEL_PY = """import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        busy_s = float(json.loads(requests[0].parameters() or "{}").get("busy_ms", 0)) / 1e3
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:  # compute-like: this core stays busy, every other thread waits
            pass
        return [pb_utils.InferenceResponse([pb_utils.Tensor("embedding", np.zeros((1, 4), np.float32))])
                for _ in requests]
"""


def measure_round_trip(s: HopSettings) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Median ms a no-op python model adds beyond its own busy time (answered at once, and after
    busy_ms), and the mean split of each by Triton's statistics (see _split)."""
    import tempfile

    import tritonclient.grpc as grpcclient

    with tempfile.TemporaryDirectory(prefix="kit_noop_") as tmp:
        repo = Path(tmp) / "repo"
        for model in ("noop", "noop_busy"):
            (repo / model / "1").mkdir(parents=True)
            (repo / model / "config.pbtxt").write_text(NOOP_CONFIG.replace('name: "noop"', f'name: "{model}"'))
            (repo / model / "1" / "model.py").write_text(NOOP_MODEL_PY)
        http, grpc_port, metrics = free_ports(3, range(18400, 18500))
        settings = ServerSettings(repository=repo, http_port=http, grpc_port=grpc_port, metrics_port=metrics,
                                  state_dir=REPO_ROOT / ".kit" / "hop_latency_noop", variant=CpuVariant())
        with LocalServer(settings) as srv:
            client = grpcclient.InferenceServerClient(srv.grpc_url)
            inp = grpcclient.InferInput("text", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([TEXT.encode()], dtype=object).reshape(1, 1))
            # One model per row, so one interleaved run gives both medians and each row's statistics.
            rows = {"no-op python model, answered at once": ("noop", 0.0),
                    f"no-op python model, stub busy {s.busy_ms:g} ms first (busy time subtracted)":
                        ("noop_busy", s.busy_ms)}
            calls = {label: (lambda m=model, ms=ms: client.infer(m, [inp], parameters={"busy_ms": ms}))
                     for label, (model, ms) in rows.items()}
            before = {}
            times = _interleaved_times(calls, s.n, after_warmup=lambda: before.update(
                {label: fetch_stats(srv.http_url, model) for label, (model, _) in rows.items()}))
            medians = {label: float(np.median(times[label])) - ms for label, (_, ms) in rows.items()}
            split = {label: _split(times[label], before[label], fetch_stats(srv.http_url, model), ms)
                     for label, (model, ms) in rows.items()}
            return medians, split


def _interleaved_times(calls: dict, n: int, block: int = 20, after_warmup=None) -> dict[str, list[float]]:
    """Ms of each call, n calls each, run in alternating blocks (the order rotates per block).

    Side by side: drift of the shared machine falls on every path alike, and each path runs back to
    back inside its block (one request in flight). `after_warmup()` runs between the 5 warm-up calls
    per path and the timed ones (a statistics snapshot).
    """
    for fn in calls.values():
        for _ in range(5):
            fn()
    if after_warmup is not None:
        after_warmup()
    times = {name: [] for name in calls}
    order = list(calls)
    for start in range(0, n, block):
        for name in order:
            for _ in range(min(block, n - start)):
                t0 = time.perf_counter()
                calls[name]()
                times[name].append((time.perf_counter() - t0) * 1000)
        order = order[1:] + order[:1]
    return times


STAT_KINDS = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def _split(client_ms: list[float], before: dict[str, float], after: dict[str, float], busy_ms: float = 0.0,
           raw_ms: list[float] | None = None) -> dict[str, float]:
    """Mean ms per request from two loadtest.stats.fetch_stats snapshots: as the client timed it, inside
    Triton (its statistics: from the request's
    arrival in the core to its response, split into queue and compute input / infer / output), and the
    rest outside Triton (gRPC frontend, loopback, client library). busy_ms comes off the compute; raw_ms
    (raw ORT, same blocks) gives the mean the compute infer is to be read against (NaN without it)."""
    per = {k: (after[f"{k}_ns"] - before[f"{k}_ns"]) / 1e6 / max(1.0, after[f"{k}_count"] - before[f"{k}_count"])
           for k in STAT_KINDS}
    per["success"] -= busy_ms
    per["compute_infer"] -= busy_ms
    client = float(np.mean(client_ms)) - busy_ms
    raw = float(np.mean(raw_ms)) if raw_ms else float("nan")
    return {"client": client, **per, "outside": client - per["success"], "raw": raw}


def measure(s: HopSettings) -> tuple[dict[str, tuple[float, float]], dict[str, dict[str, float]]]:
    """For the encoder through Triton and the text endpoint (in-process, BLS): (p50 ms, raw ORT p50 ms),
    raw ORT measured in alternating blocks with the paths of the same server, for one text; and the
    mean split of each path by Triton's statistics (see _split)."""
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(s.repository / s.name / "1" / "tokenizer" / "tokenizer.json"))
    raw_ids = tok.encode(TEXT).ids
    pad = -(-len(raw_ids) // 8) * 8
    ids = np.zeros((1, pad), np.int64)
    ids[0, :len(raw_ids)] = raw_ids
    mask = (ids != 0).astype(np.int64)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = s.threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if s.spin else "0")
    if s.spin:  # as the kit's sessions: spin inside a run, stop when it returns
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    sess = ort.InferenceSession(str(s.repository / f"{s.name}_onnx" / "1" / "model.onnx"), opts,
                                providers=["CPUExecutionProvider"])
    def raw() -> None:
        sess.run(["embedding"], {"input_ids": ids, "attention_mask": mask})

    results = {}  # path -> (its p50, raw ORT p50 in the same blocks)
    splits = {}  # path -> _split
    for mode, label in (("inprocess", "text endpoint, in-process encoder (CPU default: + tokenize)"),
                        ("bls", "text endpoint, BLS to the encoder (GPU topology: + tokenize + stub hop)")):
        http, grpc_port, metrics = free_ports(3, range(18400, 18500))
        variant = CpuVariant(intra_op_threads=s.threads, allow_spinning=s.spin,
                             text_params={**CPU_TEXT_PARAMS, "encoder": mode},
                             batching={f"{s.name}_onnx": Batching(preferred_batch_sizes=(), max_queue_delay_us=0)})
        settings = ServerSettings(repository=s.repository, http_port=http, grpc_port=grpc_port, metrics_port=metrics,
                                  state_dir=REPO_ROOT / ".kit" / "hop_latency", variant=variant)
        with LocalServer(settings) as srv:
            client = grpcclient.InferenceServerClient(srv.grpc_url)

            def encoder() -> None:
                inputs = [grpcclient.InferInput(n, list(ids.shape), "INT64") for n in ("input_ids", "attention_mask")]
                inputs[0].set_data_from_numpy(ids)
                inputs[1].set_data_from_numpy(mask)
                client.infer(f"{s.name}_onnx", inputs)

            def text() -> None:
                inp = grpcclient.InferInput("text", [1, 1], "BYTES")
                inp.set_data_from_numpy(np.array([TEXT.encode()], dtype=object).reshape(1, 1))
                client.infer(s.name, [inp])

            calls = {"raw": raw, label: text}
            models = {label: s.name}
            if mode == "inprocess":
                calls[ENCODER_PATH] = encoder
                models[ENCODER_PATH] = f"{s.name}_onnx"
            before = {}
            times = _interleaved_times(calls, s.n, after_warmup=lambda: before.update(
                {path: fetch_stats(srv.http_url, model) for path, model in models.items()}))
            for path, model in models.items():  # the BLS path's own encoder calls count on the encoder
                results[path] = (float(np.median(times[path])), float(np.median(times["raw"])))
                splits[path] = _split(times[path], before[path], fetch_stats(srv.http_url, model), raw_ms=times["raw"])
    order = [ENCODER_PATH] + [k for k in results if k != ENCODER_PATH]
    return {name: results[name] for name in order}, {name: splits[name] for name in order}


def main(argv: list[str] | None = None) -> int:
    s = _parse(argv)
    results, splits = measure(s)
    trips, trip_splits = measure_round_trip(s)
    cmd = "python -m bge_triton.loadtest.hop_latency " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"<!-- Generated by `{cmd.strip()}`; rerun it to regenerate. -->",
             "# One text, one request in flight: latency hop by hop", "",
             f"Machine: {platform.machine()}, {platform.processor() or 'CPU'}, no GPU. Model: {s.name} from "
             f"{s.repository} (synthetic models are labelled so in their export report). Text: {len(TEXT)} chars. "
             f"ONNX Runtime: {s.threads} intra-op threads, spinning {'on' if s.spin else 'off'}, both sides. "
             f"Medians of {s.n} calls per path; raw ONNX Runtime runs in alternating blocks of 20 with the "
             "paths of the same server (one server per text-endpoint mode), so each row has its own raw p50.", "",
             "| path | p50 ms | raw ORT p50 ms, same blocks | added vs raw ms |", "|---|---|---|---|"]
    lines += [f"| {name} | {ms:.2f} | {raw:.2f} | {ms - raw:+.2f} |" for name, (ms, raw) in results.items()]
    lines += ["", "The Triton round trip alone (gRPC + dynamic batcher + python stub, no ONNX Runtime), median of "
              f"{s.n} calls back to back, the two rows in alternating blocks of 20:", "",
              "| path | round trip beyond the stub's busy time, ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in trips.items()]
    lines += ["", "Where each path's time goes, by Triton's own statistics (means per request; busy time taken "
              "off the no-op rows, each served by its own copy of the no-op model). "
              "In Triton: from the request's arrival in the core to its response. Outside Triton: the "
              "client's time minus that (gRPC frontend, loopback, client library).", "",
              "| path | raw ORT ms, same blocks | client ms | in Triton ms | queue | compute input | compute infer "
              "| compute output | outside Triton ms |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {'-' if math.isnan(v['raw']) else format(v['raw'], '.2f')} | {v['client']:.2f} "
              f"| {v['success']:.2f} | {v['queue']:.2f} | {v['compute_input']:.2f} "
              f"| {v['compute_infer']:.2f} | {v['compute_output']:.2f} | {v['outside']:.2f} |"
              for name, v in {**splits, **trip_splits}.items()]
    s.out.mkdir(parents=True, exist_ok=True)
    name = f"hops_spin_{'on' if s.spin else 'off'}.md"
    (s.out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[1:]))
    print(f"wrote {s.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

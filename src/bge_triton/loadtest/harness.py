"""The one stand-up of every benchmark: a server on loopback ports (`server_settings`, `start_server`), and what bench
and tune add to it: a bench repository, one explicit-control server, config overrides.

The bench repository holds the exported real model (NAME_onnx + NAME), the canonical BGE-Large-zh
pair for the costmodel executor (an emulated GPU: no weights needed, the tokenizer is borrowed
from the exported model), and a no-op python model for the load generator's self-check. Models
are loaded one scenario at a time with a config override (no restarts).
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.errors import ExportError, ModelConfigError, ServerNotReady
from bge_triton.loadtest import loadgen
from bge_triton.loadtest.costmodel import CostModel
from bge_triton.server.cpu_variant import CpuVariant, cpu_config
from bge_triton.server.launcher import LocalServer, ServerSettings, free_ports
from bge_triton.server.repository import (
    CANONICAL_NAME,
    DEFAULT_CANONICAL,
    ENCODER_SUFFIX,
    TEXT_MODEL_PY,
    Batching,
    apply_batching,
    load_config,
    set_param,
    write_config,
)

NOOP = "noop"
EMULATED = CANONICAL_NAME  # bge_large_zh (+ _onnx) run by the costmodel executor
# A second copy of the encoder's config (its own emulated GPU: the cost model's lock lives in the model's
# directory), loaded beside the text endpoint's encoder: the quiet-hour reference called directly, side by side.
REFERENCE = CANONICAL_NAME + "_reference" + ENCODER_SUFFIX
PORT_RANGE = range(18100, 18200)


def export(model: str, repository: Path, name: str, precision: str = "fp32", *extra: str) -> Path:
    """The kit's exporter run once into repository (NAME_onnx + NAME): skipped when the ONNX file is there; the
    ONNX file's path, or ExportError naming the command to rerun by hand."""
    onnx = repository / f"{name}{ENCODER_SUFFIX}" / "1" / "model.onnx"
    if onnx.is_file():
        return onnx
    cmd = [sys.executable, "-m", "bge_triton.export", "--model", model, "--repository", str(repository),
           "--name", name, "--precision", precision, *extra]
    print("exporting:", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0 or not onnx.is_file():
        raise ExportError(f"export failed; run it by hand to see why: {' '.join(cmd)}")
    return onnx


def server_settings(repository: Path, state_dir: Path, variant: CpuVariant | None = None,
                    ports: Sequence[int] | None = None, port_range: range | None = PORT_RANGE,
                    **kwargs: Any) -> ServerSettings:
    """Settings for a local tritonserver on loopback ports (`ports`, else free ones from `port_range`; None: any)."""
    pool = port_range or range(18000, 18500)  # launcher.free_ports' default pool
    http, grpc, metrics = ports or free_ports(3, pool)
    return ServerSettings(repository=Path(repository), http_port=http, grpc_port=grpc, metrics_port=metrics,
                          state_dir=Path(state_dir), variant=variant or CpuVariant(),
                          port_pool=None if ports else pool, **kwargs)  # given ports are kept: taken = error


def start_server(repository: Path, state_dir: Path, variant: CpuVariant | None = None,
                 ports: Sequence[int] | None = None, port_range: range | None = PORT_RANGE,
                 **kwargs: Any) -> LocalServer:
    """Start (and wait for) a LocalServer that the caller owns and stops (by its pid)."""
    return LocalServer(server_settings(repository, state_dir, variant, ports, port_range, **kwargs)).start()


NOOP_MODEL_PY = '''"""No-op model for the load generator's self-check: answers zeros at once."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().shape[0]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("embedding", np.zeros((n, 1), np.float32))]))
        return out
'''



def noop_config() -> mc.ModelConfig:
    """Same inputs as an encoder, 1-float output, work-conserving batching."""
    cfg = mc.ModelConfig(name=NOOP, backend="python", max_batch_size=64)
    for name in ("input_ids", "attention_mask"):
        cfg.input.add(name=name, data_type=mc.TYPE_INT64, dims=[-1])
    cfg.output.add(name="embedding", data_type=mc.TYPE_FP32, dims=[1])
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    cfg.dynamic_batching.max_queue_delay_microseconds = 0
    return cfg


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src.resolve())


def build_repository(out: Path, real_repo: Path | None, real_name: str | None, command: str) -> Path:
    """Write the bench repository into `out` (replaced); real_repo/real_name may be None (emulated only)."""
    import shutil

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_config(noop_config(), out / NOOP / "config.pbtxt", command)
    (out / NOOP / "1").mkdir()
    (out / NOOP / "1" / "model.py").write_text(NOOP_MODEL_PY, encoding="utf-8")
    enc = load_config(DEFAULT_CANONICAL / f"{EMULATED}{ENCODER_SUFFIX}")
    write_config(enc, out / enc.name / "config.pbtxt", command)
    (out / enc.name / "1").mkdir()
    enc.name = REFERENCE
    write_config(enc, out / REFERENCE / "config.pbtxt", command)
    (out / REFERENCE / "1").mkdir()
    if real_repo is None or real_name is None:
        return out
    for name in (real_name, real_name + ENCODER_SUFFIX):
        if not (real_repo / name / "config.pbtxt").is_file():
            raise ModelConfigError(f"{real_repo}/{name} is missing: run `python -m bge_triton.export --model "
                                   f"synthetic:bge-small-zh --repository {real_repo} --name {real_name} --precision "
                                   "fp32`")
    _link(real_repo / (real_name + ENCODER_SUFFIX), out / (real_name + ENCODER_SUFFIX))
    # The text endpoint: the export's config and tokenizer, but this checkout's model.py (an export made by an
    # older checkout keeps the model.py of its day).
    _link(real_repo / real_name / "config.pbtxt", out / real_name / "config.pbtxt")
    _link(real_repo / real_name / "1" / "tokenizer", out / real_name / "1" / "tokenizer")
    _link(TEXT_MODEL_PY, out / real_name / "1" / "model.py")
    tokenizer = real_repo / real_name / "1" / "tokenizer"
    txt = load_config(DEFAULT_CANONICAL / EMULATED)
    write_config(txt, out / EMULATED / "config.pbtxt", command)
    _link(TEXT_MODEL_PY, out / EMULATED / "1" / "model.py")
    _link(tokenizer, out / EMULATED / "1" / "tokenizer")
    return out


@dataclass
class Harness:
    """One explicit-control tritonserver over the bench repository, plus config-override loading."""

    repository: Path
    state_dir: Path
    cost: CostModel
    intra_op_threads: int = 0
    cpu_lock: bool = True  # False: one instance per ONNX Runtime model, no shared CPU lock
    server: LocalServer | None = None
    self_check_result: loadgen.LoadResult | None = None  # the last self_check's whole result (errors, unanswered)

    def start(self) -> Harness:
        self.server = start_server(self.repository, self.state_dir, self.variant_for("onnxruntime"),
                                   model_control="explicit")
        import tritonclient.http as th

        self.client = th.InferenceServerClient(self.server.http_url, network_timeout=300.0)
        return self

    def variant_for(self, executor: str, **overrides) -> CpuVariant:
        """The CPU variant this harness renders with, for `executor` (overrides: other CpuVariant fields)."""
        kwargs = {"intra_op_threads": self.intra_op_threads, "cpu_lock": self.cpu_lock, **self.cost.variant_kwargs()}
        return CpuVariant(executor=executor, **{**kwargs, **overrides})

    def stop(self) -> None:
        """Close our HTTP connection first: Triton waits up to 30 s for open connections before it unloads the
        models (finalize), and the launcher's SIGKILL at 20 s would skip the unload."""
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
            self.client = None
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def live(self) -> LocalServer:
        """The running server (ServerNotReady before start() or after stop())."""
        if self.server is None:
            raise ServerNotReady("the bench harness has no server: call start() first")
        return self.server

    @property
    def host_port(self) -> tuple[str, int]:
        return "127.0.0.1", self.live.settings.http_port

    def rendered(self, name: str) -> mc.ModelConfig:
        """The CPU-variant config the server would load for `name`."""
        return load_config(self.state_dir / "repository" / name)

    def load(self, name: str, knobs: Batching | None = None, executor: str | None = None,
             params: Mapping[str, object] | None = None, variant: CpuVariant | None = None) -> mc.ModelConfig:
        """(Re)load one model with batching knobs / executor / parameters applied as a config override.

        `variant` re-derives the model from the bench repository's config with that CPU variant instead of
        using the server's rendering (the emulated GPU's text endpoint keeps the GPU settings that way).
        """
        if variant is None and executor is not None:  # instance counts follow the executor (CpuVariant)
            variant = self.variant_for(executor)
        cfg = cpu_config(load_config(self.repository / name), variant) if variant else self.rendered(name)
        if knobs is not None:
            cfg = apply_batching(cfg, knobs)
        if executor is not None:
            set_param(cfg, "executor", executor)
        for key, value in (params or {}).items():
            set_param(cfg, key, value)
        self.client.load_model(name, config=json_format.MessageToJson(cfg, preserving_proto_field_name=True))
        if not self.client.is_model_ready(name):
            raise ServerNotReady(f"model {name} did not become ready; see {self.live.log_path}")
        return cfg

    def unload(self, name: str) -> None:
        self.client.unload_model(name)

    def self_check(self, concurrency: int, duration_s: float, processes: int = 1, ramp_s: float = 0.0) -> float:
        """Requests per second the generator sustains against the no-op model (its ceiling here)."""
        self.load(NOOP)
        spec = loadgen.LoadSpec(*self.host_port, NOOP, tuple(loadgen.tensor_bodies(64, 32)), "closed",
                                concurrency=concurrency, warmup_s=0.5 + ramp_s, duration_s=duration_s,
                                processes=processes, ramp_s=ramp_s)
        res = self.self_check_result = loadgen.run(spec)
        self.unload(NOOP)
        return res.throughput

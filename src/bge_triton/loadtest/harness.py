"""The one stand-up of every benchmark: a server on loopback ports (`server_settings`, `start_server`), the exporter,
and a bench repository (the exported model, the canonical pair run by the costmodel executor as an emulated GPU, a
no-op) served by one explicit-control server (Harness) that loads models with config overrides."""
from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tritonclient.http as th
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.errors import ExportError, ModelConfigError, ServerNotReady
from bge_triton.loadtest import loadgen
from bge_triton.loadtest.costmodel import CostModel
from bge_triton.repository import (
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
from bge_triton.server.cpu_variant import CpuVariant, cpu_config
from bge_triton.server.launcher import LocalServer, ServerSettings, free_ports

NOOP = "noop"
EMULATED = CANONICAL_NAME  # bge_large_zh (+ _onnx) run by the costmodel executor
# A second emulated encoder (its own GPU: the cost model's lock is in the model's directory): the quiet-hour reference.
REFERENCE = CANONICAL_NAME + "_reference" + ENCODER_SUFFIX
PORT_RANGE = range(18100, 18200)


def export(model: str, repository: Path, name: str, precision: str = "fp32", *extra: str) -> Path:
    """The exporter run once into repository (skipped when the ONNX file is there): its path, or ExportError."""
    onnx = repository / f"{name}{ENCODER_SUFFIX}" / "1" / "model.onnx"
    if onnx.is_file():
        return onnx
    cmd = [sys.executable, "-m", "bge_triton.export", "--model-id", model, "--repository", str(repository),
           "--model", name, "--precision", precision, *extra]
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
    """Start (and wait for) a LocalServer that the caller owns and stops."""
    return LocalServer(server_settings(repository, state_dir, variant, ports, port_range, **kwargs)).start()


NOOP_MODEL_PY = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # zeros at once: the load generator's self-check
        return [pb_utils.InferenceResponse([pb_utils.Tensor("embedding", np.zeros((pb_utils.get_input_tensor_by_name(
            request, "input_ids").as_numpy().shape[0], 1), np.float32))]) for request in requests]
'''


def build_repository(out: Path, real_repo: Path | None, real_name: str | None, command: str) -> Path:
    """Write the bench repository into `out` (replaced); real_repo/real_name may be None (emulated only)."""
    if out.exists():
        shutil.rmtree(out)
    noop = mc.ModelConfig(  # an encoder's inputs, a 1-float output, work-conserving batching
        name=NOOP, backend="python", max_batch_size=64,
        input=[mc.ModelInput(name=n, data_type=mc.TYPE_INT64, dims=[-1]) for n in ("input_ids", "attention_mask")],
        output=[mc.ModelOutput(name="embedding", data_type=mc.TYPE_FP32, dims=[1])],
        instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)],
        dynamic_batching=mc.ModelDynamicBatching(max_queue_delay_microseconds=0))
    write_config(noop, out / NOOP / "config.pbtxt", command)
    (out / NOOP / "1").mkdir()
    (out / NOOP / "1" / "model.py").write_text(NOOP_MODEL_PY, encoding="utf-8")
    enc = load_config(DEFAULT_CANONICAL / f"{EMULATED}{ENCODER_SUFFIX}")
    for name in (enc.name, REFERENCE):
        enc.name = name
        write_config(enc, out / name / "config.pbtxt", command)
        (out / name / "1").mkdir()
    if real_repo is None or real_name is None:
        return out
    for name in (real_name, real_name + ENCODER_SUFFIX):
        if not (real_repo / name / "config.pbtxt").is_file():
            raise ModelConfigError(f"{real_repo}/{name} is missing: run `bge-triton export --model-id "
                                   f"synthetic:bge-small-zh --repository {real_repo} --model {real_name} --precision "
                                   "fp32`")
    write_config(load_config(DEFAULT_CANONICAL / EMULATED), out / EMULATED / "config.pbtxt", command)
    # The text endpoints: the export's config and tokenizer, but this checkout's model.py (an export made by an
    # older checkout keeps the model.py of its day).
    tokenizer = real_repo / real_name / "1" / "tokenizer"
    for src, dst in ((real_repo / (real_name + ENCODER_SUFFIX), real_name + ENCODER_SUFFIX),
                     (real_repo / real_name / "config.pbtxt", f"{real_name}/config.pbtxt"),
                     (tokenizer, f"{real_name}/1/tokenizer"), (TEXT_MODEL_PY, f"{real_name}/1/model.py"),
                     (TEXT_MODEL_PY, f"{EMULATED}/1/model.py"), (tokenizer, f"{EMULATED}/1/tokenizer")):
        (out / dst).parent.mkdir(parents=True, exist_ok=True)
        (out / dst).symlink_to(src.resolve())
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
    client: Any = None  # tritonclient.http, once started

    def start(self) -> Harness:
        self.server = start_server(self.repository, self.state_dir, self.variant_for("onnxruntime"),
                                   model_control="explicit")
        self.client = th.InferenceServerClient(self.server.http_url, network_timeout=300.0)
        return self

    def variant_for(self, executor: str, **overrides) -> CpuVariant:
        """The CPU variant this harness renders `executor` with (overrides: other CpuVariant fields)."""
        kwargs = {"intra_op_threads": self.intra_op_threads, "cpu_lock": self.cpu_lock, **self.cost.variant_kwargs()}
        return CpuVariant(executor=executor, **{**kwargs, **overrides})

    def stop(self) -> None:
        """Our HTTP connection closes first: Triton waits 30 s for open ones before it unloads the models."""
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()
        self.client = self.server = None

    @property
    def live(self) -> LocalServer:
        """The running server (ServerNotReady before start() or after stop())."""
        if self.server is None:
            raise ServerNotReady("the bench harness has no server: call start() first")
        return self.server

    @property
    def host_port(self) -> tuple[str, int]:
        return "127.0.0.1", self.live.settings.http_port

    def load(self, name: str, knobs: Batching | None = None, executor: str | None = None,
             params: Mapping[str, object] | None = None, variant: CpuVariant | None = None) -> mc.ModelConfig:
        """(Re)load one model with batching knobs / executor / parameters as a config override; `variant`: rendered
        from the bench repository's config with that CPU variant instead of the server's rendering."""
        if variant is None and executor is not None:  # instance counts follow the executor (CpuVariant)
            variant = self.variant_for(executor)
        cfg = (cpu_config(load_config(self.repository / name), variant) if variant
               else load_config(self.state_dir / "repository" / name))  # else: the server's own rendering
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

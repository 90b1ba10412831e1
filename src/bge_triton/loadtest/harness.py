"""The one stand-up of every tritonserver the load tests run (tests/unit/test_one_standup.py keeps it one):
`server_settings` chooses ports, state dir, variant, model control; `launch` / `start_server` start one
and wait until ready (the caller stops it); `serve_up` / `WatchedServer` run the same settings as `bge-triton serve
up`, for what a user sees (its start-up errors, its --watch restarts). And the bench repository (the exported model,
the canonical pair on the costmodel executor as an emulated GPU, a no-op) on one explicit-control server (Harness)."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
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
from bge_triton.server.launcher import LocalServer, ServerSettings, free_ports, log_tail, stop_pid

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


def launch(settings: ServerSettings) -> LocalServer:
    """THE start of a load test's tritonserver: render the CPU variant, start, wait until ready (a port taken after
    the pick: new ones from settings.port_pool, or PortInUse when the ports were given); the caller stops it."""
    return LocalServer(settings).start()


def start_server(repository: Path, state_dir: Path, variant: CpuVariant | None = None,
                 ports: Sequence[int] | None = None, port_range: range | None = PORT_RANGE,
                 **kwargs: Any) -> LocalServer:
    """Start (and wait for) a LocalServer that the caller owns and stops (`with start_server(...) as srv:` stops it
    when the block ends, however it ends)."""
    return launch(server_settings(repository, state_dir, variant, ports, port_range, **kwargs))


def serve_up_argv(settings: ServerSettings, watch_s: float = 0.0) -> list[str]:
    """`bge-triton serve up` (python -m bge_triton.server up) with these settings and ports (kept: the command line
    has no pool); ValueError for a setting that command cannot say."""
    s, v = settings, settings.variant
    said = CpuVariant(executor=v.executor, intra_op_threads=v.intra_op_threads, cpu_lock=v.cpu_lock)
    loads = ("*",) if s.model_control == "explicit" else ()
    if v != said or s.load_models != loads or s.extra_args or s.stub_packages is not None or s.log_verbose:
        raise ValueError("`bge-triton serve up` sets only the executor, threads and CPU lock of the variant and loads "
                         "every model under explicit control: start these settings with harness.launch instead")
    argv = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(s.repository),
            "--http-port", str(s.http_port), "--grpc-port", str(s.grpc_port), "--metrics-port", str(s.metrics_port),
            "--state-dir", str(s.state_dir), "--model-control", s.model_control, "--executor", v.executor,
            "--threads", str(v.intra_op_threads), "--ready-timeout", f"{s.ready_timeout_s:g}"]
    argv += [] if v.cpu_lock else ["--no-cpu-lock"]
    argv += ["--admin-key", s.admin_key] if s.admin_key else []
    return argv + (["--watch", f"{watch_s:g}"] if watch_s > 0 else [])


def serve_up(settings: ServerSettings, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`bge-triton serve up` run to its end as a user types it (its exit code and words are what is tested); a
    server it left running is stopped by the pid in its state dir."""
    proc = subprocess.run(serve_up_argv(settings), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode == 0 and (pid_file := Path(settings.state_dir) / "server.pid").exists():
        stop_pid(int(pid_file.read_text()))
        pid_file.unlink(missing_ok=True)
    return proc


class WatchedServer:
    """`bge-triton serve up --watch S` in its own process, as a user runs it (its canary decides every restart),
    started and ready; its stdout lines kept with their arrival time, the log tail of each server it replaced."""

    def __init__(self, settings: ServerSettings, every_s: float) -> None:
        self.settings, self.state = settings, Path(settings.state_dir)
        self.lines: list[tuple[float, str]] = []
        self.old_logs: list[str] = []
        self.proc = subprocess.Popen(argv := serve_up_argv(settings, every_s), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + settings.ready_timeout_s + 30.0
        while not any("tritonserver ready" in ln for _, ln in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerNotReady("`" + " ".join(argv) + "` did not come up:\n"
                                     + "".join(ln for _, ln in self.lines[-30:]))
            time.sleep(0.2)

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self.lines.append((time.monotonic(), line))
            if "watch: restarting" in line:  # the old server's log, before the restart reopens the file
                self.old_logs.append(log_tail(self.state / "tritonserver.log", 30))

    def seen(self, what: str) -> list[tuple[float, str]]:
        """(time, text in parentheses) of each 'watch: restarting (why)' or 'watch: ready again' line."""
        return [(t, ln.split("(", 1)[-1].rsplit(")", 1)[0]) for t, ln in self.lines if f"watch: {what}" in ln]

    def server_pid(self) -> int | None:
        """The tritonserver pid the watcher runs now, checked to be its child (None while it restarts)."""
        import psutil

        try:
            pid = int((self.state / "server.pid").read_text())
            proc = psutil.Process(pid)
            if proc.ppid() != self.proc.pid or proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except (OSError, ValueError, psutil.NoSuchProcess):
            return None
        return pid

    def stop(self) -> int:
        """SIGTERM the watcher (it stops its server; after 60 s SIGKILL, and its server's pid); its exit code."""
        pid = self.server_pid()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=10)
            if pid:
                stop_pid(pid)
            return rc


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

"""The harness core's target: the Triton a measurement runs against, given by `--url` (a server the user runs) or
started by the kit, with its served configs, config overrides that are always undone, statistics and metrics.

A scenario that changes the batcher goes through `Target.overriding(...)`: the served config is read from the
server, only the batching fields change, and the config found is loaded back on success, failure and Ctrl-C.
"""
from __future__ import annotations

import contextlib
import json
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.errors import InputError, KitError, ServerNotReady
from bge_triton.flags import ServerUrl, server_url
from bge_triton.loadtest.report import load_average
from bge_triton.repository import ENCODER_SUFFIX, Batching, apply_batching, dump_config

ADMIN_HEADER = "triton-admin-key"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # Triton's gRPC front end reads restricted keys under this prefix


def override_config(served: mc.ModelConfig, knobs: Batching) -> mc.ModelConfig:
    """The served config with only its batching fields changed (instances, queue policy, accelerators stay).

    `knobs.max_batch_size` is never applied: the server's model was built for its own limit."""
    limit = served.max_batch_size
    if not limit and knobs.enabled:
        raise InputError(f"{served.name}: max_batch_size is 0 (no batching) on the server; batching scenarios need a "
                         "model served with max_batch_size > 0")
    sizes = knobs.preferred_batch_sizes
    if sizes and limit and max(sizes) > limit:
        raise InputError(f"{served.name}: preferred sizes {list(sizes)} exceed the served max_batch_size {limit}; "
                         "choose sizes up to it")
    out = apply_batching(served, Batching(knobs.enabled, sizes, knobs.max_queue_delay_us))
    if not knobs.enabled:  # batch 1: no dynamic batcher, each request runs on its own
        out.ClearField("dynamic_batching")
    return out


def config_json(cfg: mc.ModelConfig) -> str:
    """A config as the JSON Triton's load API takes for its `config` parameter."""
    return json_format.MessageToJson(cfg, preserving_proto_field_name=True)


def config_diff(before: mc.ModelConfig, after: mc.ModelConfig) -> str:
    """A unified diff of two configs in Triton's text format ('' when equal)."""
    import difflib

    return "".join(difflib.unified_diff(dump_config(before).splitlines(True), dump_config(after).splitlines(True),
                                        "served", "candidate"))


def parse_metrics(text: str) -> dict[str, float]:
    """Mean utilisation (0..1) of Triton's metrics page: {"gpu": ..., "cpu": ...} for the gauges present."""
    out: dict[str, float] = {}
    for key, metric in (("gpu", "nv_gpu_utilization"), ("cpu", "nv_cpu_utilization")):
        values = [float(m.group(1)) for m in re.finditer(rf"^{metric}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)]
        if values:
            out[key] = sum(values) / len(values)
    return out


@dataclass
class Target:
    """A running Triton: where (url), the text endpoint and its encoder, the admin key, the metrics page."""

    url: ServerUrl
    model: str
    encoder: str = ""  # "" = read from the text endpoint's config (parameter onnx_model), else NAME_onnx
    admin_key: str | None = None
    metrics_url: str | None = None  # None = http://HOST:8002/metrics; "" = none
    started: bool = False  # True: the kit started this server (it may stop or restart it)
    _client: Any = field(default=None, repr=False)
    _server: Any = field(default=None, repr=False)  # the LocalServer when started
    loaded: set[str] = field(default_factory=set)  # models this run has (re)loaded: the ones to restore

    @classmethod
    def start_local(cls, repository: Path, state_dir: Path, model: str, admin_key: str | None = None,
                    **settings: Any) -> Target:
        """A local tritonserver the kit starts, as a user runs one: explicit model control, every model loaded,
        the repository API behind `admin_key` when given; stop() stops it (by its pid)."""
        from bge_triton.loadtest import harness

        srv = harness.start_server(repository, state_dir, model_control="explicit", load_models=("*",),
                                   admin_key=admin_key, **settings)
        target = cls(ServerUrl("grpc", srv.grpc_url), model, "", admin_key, srv.metrics_url, started=True,
                     _server=srv)
        target.check_ready()
        return target

    @property
    def server(self) -> Any:
        """The LocalServer of a started target (its pid, ports, log); an error for a target given by URL."""
        if self._server is None:
            raise InputError(f"the server at {self.url} was not started by the kit: it cannot be stopped or "
                             "restarted from here")
        return self._server

    def stop(self) -> None:
        """Close the client; stop the server if the kit started it."""
        self.close()
        if self._server is not None:
            self._server.stop()
            self._server = None

    @classmethod
    def from_flags(cls, url: str, model: str, encoder: str | None, admin_key: str | None,
                   metrics_url: str | None) -> Target:
        parsed = server_url(url)
        metrics = f"http://{parsed.host}:8002/metrics" if metrics_url is None else metrics_url
        return cls(parsed, model, encoder or "", admin_key, metrics)

    @property
    def client(self) -> Any:
        """tritonclient's sync client for the URL's protocol (opened once)."""
        if self._client is None:
            if self.url.protocol == "grpc":
                import tritonclient.grpc as tc
            else:
                import tritonclient.http as tc
            self._client = tc.InferenceServerClient(self.url.address, network_timeout=600.0) \
                if self.url.protocol == "http" else tc.InferenceServerClient(self.url.address)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def admin_headers(self) -> dict[str, str] | None:
        if not self.admin_key:
            return None
        name = GRPC_HEADER_PREFIX + ADMIN_HEADER if self.url.protocol == "grpc" else ADMIN_HEADER
        return {name: self.admin_key}

    def check_ready(self) -> None:
        """The server is ready and serves the text endpoint; resolves the encoder's name."""
        try:
            ready = self.client.is_server_ready() and self.client.is_model_ready(self.model)
        except Exception as exc:  # tritonclient raises its own types, and socket errors on a dead address
            raise ServerNotReady(f"no Triton answers at --url {self.url}: {exc}; start it, or check the address "
                                 "(HOST:PORT is gRPC, port 8001; http://HOST:PORT is HTTP, port 8000)") from exc
        if not ready:
            raise ServerNotReady(f"the server at {self.url} does not serve a ready model {self.model!r}: name the "
                                 "text endpoint with --model (`curl HOST:8000/v2/repository/index` lists them)")
        if not self.encoder:
            params = self.config(self.model).parameters
            self.encoder = params["onnx_model"].string_value if "onnx_model" in params else self.model + ENCODER_SUFFIX
        if not self.client.is_model_ready(self.encoder):
            raise ServerNotReady(f"the encoder {self.encoder!r} is not ready on {self.url}: name it with --encoder")

    def version(self) -> str:
        """The server's own name and version (its metadata), e.g. 'triton 2.51.0'."""
        try:
            meta = self.client.get_server_metadata()
        except Exception:  # metadata is informational: a report still gets written without it
            return "version unknown"
        name, version = (meta.name, meta.version) if self.url.protocol == "grpc" else (meta.get("name"),
                                                                                        meta.get("version"))
        return f"{name} {version}"

    def config(self, name: str) -> mc.ModelConfig:
        """The config the server serves for `name` (its get_model_config)."""
        got = self.client.get_model_config(name)
        if self.url.protocol == "grpc":
            return got.config
        return json_format.ParseDict(got, mc.ModelConfig(), ignore_unknown_fields=True)

    def load(self, name: str, cfg: mc.ModelConfig) -> None:
        """Load `name` with `cfg` as a config override (a reload: the old model serves until the new one is ready)."""
        try:
            self.client.load_model(name, config=config_json(cfg), headers=self.admin_headers)
            self.loaded.add(name)
        except Exception as exc:  # tritonclient's InferenceServerException and transport errors
            text = str(exc)
            if "restricted" in text or "403" in text or "401" in text:
                raise KitError(f"the server refused to load {name}: its model-repository API is restricted; give "
                               "its key with --admin-key (env BGE_TRITON_ADMIN_KEY; compose: `docker compose exec "
                               f"triton cat /secrets/admin_key`). Server said: {text}") from exc
            if "explicit" in text or "polling" in text.lower():
                raise KitError(f"the server refused to load {name}: start it with --model-control-mode=explicit "
                               f"--load-model='*'. Server said: {text}") from exc
            raise KitError(f"loading {name} with a config override failed: {text}") from exc

    @contextlib.contextmanager
    def overriding(self, name: str, make: Callable[[mc.ModelConfig], mc.ModelConfig] | None = None,
                   keep: Callable[[], bool] = lambda: False) -> Iterator[tuple[mc.ModelConfig, mc.ModelConfig]]:
        """Read the served config of `name`; load make(served) (None: the served one as is); yield (served, loaded);
        then load the served config back, on success, failure and Ctrl-C, unless keep() says to keep the new one."""
        served = self.config(name)
        loaded = make(served) if make else served
        if make is not None:  # a load that fails leaves the served model serving: nothing to restore then
            self.load(name, loaded)
        try:
            yield served, loaded
        finally:
            if make is not None and not keep():
                restore(self, name, served)

    @contextlib.contextmanager
    def holding(self, names: Sequence[str], keep: Callable[[], bool] = lambda: False,
                rescue: Path | None = None) -> Iterator[dict[str, mc.ModelConfig]]:
        """Read the served configs of `names` (the encoder before the text endpoint that calls it) and yield them;
        the scenario loads what it likes (load() records each name); on leaving, on success, failure, Ctrl-C and
        SIGTERM (stop_like_ctrl_c), every model loaded meanwhile gets its served config back, in the reverse order:
        the text endpoint first, then its encoder, so the endpoint runs on settings measured with the encoder
        loaded at each step. keep() true: the loaded configs stay. A failed restore writes NAME.pbtxt under
        `rescue` and raises a KitError that says how to load it back."""
        served = {name: self.config(name) for name in names}
        before = set(self.loaded)
        self.loaded -= set(names)
        try:
            yield served
        finally:
            if not keep():
                restore_all(self, {n: served[n] for n in names if n in self.loaded}, rescue)
            self.loaded |= before

    def stats(self, name: str) -> dict[str, Any]:
        """Triton's inference statistics of `name` as JSON (its batch_stats included)."""
        got = self.client.get_inference_statistics(name, as_json=True) if self.url.protocol == "grpc" \
            else self.client.get_inference_statistics(name)
        return dict(got)

    def utilisation(self, timeout_s: float = 2.0) -> dict[str, float]:
        """Triton's GPU/CPU utilisation gauges now ({} when the metrics page is off or has neither)."""
        if not self.metrics_url:
            return {}
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=timeout_s) as resp:
                return parse_metrics(resp.read().decode(errors="replace"))
        except (OSError, urllib.error.URLError, ValueError):
            return {}


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def stop_like_ctrl_c() -> None:
    """Make SIGTERM raise KeyboardInterrupt, so a stop request restores the served config as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _interrupt)


def opening(parse_args: Callable[[Sequence[str]], Any], argv: Sequence[str] | None) -> tuple[Any, tuple, float]:
    """The start of every --url command: its flags parsed, SIGTERM made a Ctrl-C (stop_like_ctrl_c), and
    report.load_average() and the clock at start, for its report's header."""
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    stop_like_ctrl_c()
    return a, load_average(), time.monotonic()


def restore(target: Target, name: str, served: mc.ModelConfig) -> None:
    """Load the served config back; a second Ctrl-C cannot cut it short (it waits for the reload)."""
    previous = signal.getsignal(signal.SIGINT)
    with contextlib.suppress(ValueError):  # signal handlers can be set from the main thread only
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        target.load(name, served)
        print(f"restored the served config of {name}", flush=True)
    finally:
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGINT, previous)


def restore_all(target: Target, served: Mapping[str, mc.ModelConfig], rescue: Path | None = None) -> None:
    """Load each served config back, in the REVERSE order of `served` (the text endpoint before its encoder);
    Ctrl-C and SIGTERM cannot cut it short. Every model is tried; the ones that fail are written under `rescue`
    and named in one KitError."""
    held = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with contextlib.suppress(ValueError):  # signal handlers can be set from the main thread only
        for sig in held:
            signal.signal(sig, signal.SIG_IGN)
    failed: list[str] = []
    try:
        for name in reversed(list(served)):
            try:
                target.load(name, served[name])
                print(f"restored the served config of {name}", flush=True)
            except KitError as exc:
                failed.append(f"{name} ({exc})")
                if rescue is not None:
                    rescue.mkdir(parents=True, exist_ok=True)
                    (rescue / f"{name}.pbtxt").write_text(dump_config(served[name]), encoding="utf-8")
    finally:
        with contextlib.suppress(ValueError, TypeError):
            for sig, handler in held.items():
                signal.signal(sig, handler)
    if failed:
        where = f"the config in {rescue}/NAME.pbtxt" if rescue is not None else "its served config"
        raise KitError(f"could not load the served config back: {'; '.join(failed)}. Load each yourself: "
                       f"tritonclient's load_model(NAME, config=...) with {where}, or restart the server")


def batch_counts(stats: Mapping[str, Any]) -> dict[int, int]:
    """{batch size: executions} from a statistics JSON's batch_stats (summed over versions)."""
    out: dict[int, int] = {}
    for entry in stats.get("model_stats", []):
        for b in entry.get("batch_stats", []):
            size, count = int(b.get("batch_size", 0)), int(b.get("compute_infer", {}).get("count", 0))
            out[size] = out.get(size, 0) + count
    return out


def counts_delta(before: Mapping[int, int], after: Mapping[int, int]) -> dict[int, int]:
    """The batches formed between two batch_counts snapshots (sizes with none left out)."""
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0) > 0}


def batches_text(counts: Mapping[int, int], top: int = 4) -> str:
    """'32x10 1x3 (avg 24.6)': the most frequent sizes and the mean batch, for a report cell."""
    total = sum(counts.values())
    if not total:
        return "-"
    mean = sum(k * v for k, v in counts.items()) / total
    common = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return " ".join(f"{k}x{v}" for k, v in common) + (" ..." if len(counts) > top else "") + f" (avg {mean:.1f})"


def as_json(cfg: mc.ModelConfig) -> dict[str, Any]:
    return json.loads(config_json(cfg))


def add_target_flags(p: Any) -> None:
    """The flags of a measurement against a running Triton (bench seed --url, tune --url)."""
    from bge_triton import flags

    flags.add_url(p, None, help="the running Triton to measure: HOST:PORT speaks gRPC (port 8001), http://HOST:PORT "
                  "speaks HTTP (port 8000); without it the command measures a local server it starts itself")
    flags.add_model(p)
    p.add_argument("--encoder", default=None, metavar="NAME", help="the encoder's served name (default: read from "
                   "the text endpoint's config, parameter onnx_model; else MODEL_onnx)")
    flags.add_admin_key(p)
    p.add_argument("--metrics-url", default=None, metavar="URL", help="Triton's metrics page for GPU/CPU "
                   "utilisation (default: http://HOST:8002/metrics of --url's host; '' = none)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="the text endpoint's tokenizer, for the tensor "
                   "rows (default: model_repository/MODEL/1/tokenizer under the current directory)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per text at most; tensor rows are padded to it")


def target_from(args: Any) -> Target:
    """A ready Target from add_target_flags' values (its encoder resolved)."""
    t = Target.from_flags(args.url, args.model, args.encoder, args.admin_key, args.metrics_url)
    t.check_ready()
    return t


def tokenizer_path(args: Any) -> str:
    return args.tokenizer or f"model_repository/{args.model}/1/tokenizer"

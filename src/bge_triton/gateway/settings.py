"""GatewaySettings: everything the gateway needs, built once from flags (`bge-triton gateway --help`)."""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from bge_triton import flags
from bge_triton.client.core import BGE_QUERY_INSTRUCTION
from bge_triton.errors import InputError

__all__ = ["GatewaySettings", "build_parser", "settings_from_args", "load_keys", "triton_target"]

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: addresses no other machine can reach."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class GatewaySettings:
    """One gateway process: where Triton is, what it serves, its limits and its keys."""

    triton: str = "127.0.0.1:8001"
    model: str = "bge_large_zh"
    served_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    tokenizer: str | None = None
    model_repository: str | None = None
    api_keys: frozenset[str] = frozenset()
    unsafe_no_auth: bool = False
    rate_limit: float = 0.0  # requests per second per key (0 = no limit)
    rate_burst: int = 20
    max_body_bytes: int = 8 * 1024 * 1024
    max_inputs: int = 2048
    max_in_flight: int = 512
    timeout_s: float = 30.0
    triton_attempts: int = 2
    query_priority: int = 1
    passage_priority: int = 2
    query_instruction: str = BGE_QUERY_INSTRUCTION
    canary_interval_s: float = 1.0
    ready_max_age_s: float = 3.0
    retry_after_s: int = 1
    micro_batch: bool = True  # one-text requests share Triton calls through the SDK's MicroBatcher
    micro_batch_wait_s: float = 0.002
    # Idle keep-alive connections are closed after this long. Longer than the idle timeouts of the clients and
    # proxies in front (nginx 75 s, AWS ALB 60 s, aiohttp 15 s): a server that closes first races a request
    # sent on the closing connection ("Server disconnected", a 502 at the proxy). uvicorn's own default is 5 s.
    keep_alive_s: float = 90.0
    max_input_chars: int = 0  # characters per text; 0 = 250 x the model's max_length (TEI's rule)
    parse_workers: int = 2  # worker processes that parse bodies over 64 KiB (off the event loop)
    log_level: str = "info"
    # the export's NAME_onnx/1/reference.json: /ready stays 503 until the served model reproduces its vectors
    reference: str | None = None
    verify_retry_s: float = 30.0  # a failed verdict is checked again after this long (a fixed model may be loaded)
    rerank_model: str | None = None  # the reranker's text-pair endpoint: serves /rerank and /v1/rerank when set

    def __post_init__(self) -> None:
        if not self.api_keys and not self.unsafe_no_auth and not is_loopback(self.host):
            raise InputError(f"--host {self.host} without an API key would serve embeddings to anyone who can "
                             "reach this machine: give --api-key / --api-keys-file, or bind 127.0.0.1 "
                             "(--unsafe-no-auth only inside a container whose port is published on 127.0.0.1)")
        if self.max_input_chars < 0:
            raise InputError(f"--max-input-chars {self.max_input_chars}: must be >= 0 (0 = 250 x the model's "
                             "max_length)")
        for name in ("max_body_bytes", "max_inputs", "max_in_flight", "rate_burst", "triton_attempts",
                     "parse_workers"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.rate_limit < 0 or self.timeout_s <= 0 or self.canary_interval_s <= 0 or self.micro_batch_wait_s < 0 \
                or self.keep_alive_s <= 0 or self.verify_retry_s <= 0:
            raise InputError("--rate-limit and --micro-batch-wait-ms must be >= 0, --timeout, --canary-interval, "
                             "--verify-retry and --keep-alive > 0 s")
        if self.ready_max_age_s < self.canary_interval_s:
            raise InputError(f"--ready-max-age {self.ready_max_age_s} < --canary-interval {self.canary_interval_s}: "
                             "the gateway would flap between ready and not ready; raise --ready-max-age")
        if self.query_priority < 0 or self.passage_priority < 0:
            raise InputError("--query-priority / --passage-priority are Triton priority levels: 1 = highest, "
                             "0 = the model's default level")

    @property
    def names(self) -> tuple[str, ...]:
        """The model names `model` may carry: the Triton model's name first, then the aliases."""
        return (self.model, *[n for n in self.served_names if n != self.model])

    @property
    def tokenizer_dir(self) -> str | None:
        """An optional local copy of the text endpoint's tokenizer (--tokenizer, or MODEL_REPOSITORY/<model>/1/
        tokenizer): only truncate START against a text endpoint too old to cut the start itself needs it."""
        if self.tokenizer:
            return self.tokenizer
        if self.model_repository:
            return str(Path(self.model_repository) / self.model / "1" / "tokenizer")
        return None


def load_keys(keys: Sequence[str], keys_file: str | None) -> frozenset[str]:
    """API keys from --api-key flags and a keys file (one key per line, '#' comments)."""
    out = {k.strip() for k in keys if k.strip()}
    if keys_file:
        path = Path(keys_file)
        if not path.is_file():
            raise InputError(f"--api-keys-file {keys_file}: no such file; write one key per line")
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                out.add(line)
    short = [k for k in out if len(k) < 16]
    if short:
        raise InputError(f"{len(short)} API key(s) shorter than 16 characters: use long random keys, "
                         "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return frozenset(out)


GRPC_TARGETS = ("dns:", "ipv4:", "ipv6:", "unix:")  # gRPC name-resolver targets, passed through as given


def build_parser() -> argparse.ArgumentParser:
    """The gateway's flags; one GatewaySettings is built from them."""
    d = GatewaySettings
    p = flags.parser("bge-triton gateway", "OpenAI-compatible /v1/embeddings (and TEI's /embed) in front of the "
                     "Triton text endpoint.")
    flags.add_url(p, d.triton, "--triton", help="the running Triton's gRPC address: HOST:PORT (port 8001), or a "
                  "gRPC target such as dns:///triton-headless:8001 to balance over several servers; --triton is "
                  "the same flag")
    flags.add_model(p, d.model, help="the served model's name on Triton (the text endpoint); also the name clients "
                    "send as `model`")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name clients may send as `model`, e.g. BAAI/bge-large-zh-v1.5 (repeatable)")
    p.add_argument("--host", default=d.host, help="bind address (an address other machines reach needs an API key)")
    p.add_argument("--port", type=int, default=d.port, help="the gateway's HTTP port")
    p.add_argument("--model-repository", default=None, metavar="DIR", help="optional: a local tokenizer from "
                   "DIR/<model>/1/tokenizer, only for truncate START against a text endpoint that cannot cut the "
                   "start itself")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="optional: that tokenizer's directory "
                   "(tokenizer.json) instead")
    p.add_argument("--max-input-chars", type=int, default=d.max_input_chars,
                   help="characters per text: longer ones are cut before tokenizing (truncate START / END) or "
                   "refused 413 (NONE); 0 = 250 x the model's max_length")
    p.add_argument("--parse-workers", type=int, default=d.parse_workers,
                   help="worker processes that parse bodies over 64 KiB (JSON parsing holds the GIL)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="an accepted bearer key (repeatable; the variable takes a comma-separated list)")
    p.add_argument("--api-keys-file", default=None, metavar="PATH", help="a file of accepted keys, one per line")
    p.add_argument("--unsafe-no-auth", action="store_true",
                   help="allow a non-loopback --host without keys (only behind a port published on 127.0.0.1)")
    p.add_argument("--rate-limit", type=float, default=d.rate_limit, help="requests/s per key (0 = unlimited)")
    p.add_argument("--rate-burst", type=int, default=d.rate_burst, help="requests a key may send at once")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="413 above this body size")
    p.add_argument("--max-inputs", type=int, default=d.max_inputs, help="413 above this many inputs per request")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight,
                   help="requests at Triton at once; more get 503 + Retry-After")
    p.add_argument("--timeout", type=float, default=d.timeout_s, metavar="SECONDS", help="per-request Triton timeout")
    p.add_argument("--triton-attempts", type=int, default=d.triton_attempts,
                   help="attempts per Triton call on overload and connection errors (within the SDK's retry budget)")
    p.add_argument("--query-priority", type=int, default=d.query_priority, help="Triton priority level of queries "
                   "(1 = highest)")
    p.add_argument("--passage-priority", type=int, default=d.passage_priority, help="Triton priority level of "
                   "passages")
    p.add_argument("--query-instruction", default=d.query_instruction, help="prepended for input_type=query")
    p.add_argument("--canary-interval", type=float, default=d.canary_interval_s, metavar="SECONDS",
                   help="seconds between canary embeddings")
    p.add_argument("--ready-max-age", type=float, default=d.ready_max_age_s, metavar="SECONDS",
                   help="/ready is 200 while an embedding succeeded within this many seconds")
    p.add_argument("--no-micro-batch", action="store_true",
                   help="send each one-text request on its own instead of through the SDK's MicroBatcher")
    p.add_argument("--micro-batch-wait-ms", type=float, default=d.micro_batch_wait_s * 1e3, metavar="MS",
                   help="while a batch is in flight, let the next fill for up to this long (work-conserving)")
    p.add_argument("--keep-alive", type=float, default=d.keep_alive_s, metavar="SECONDS",
                   help="seconds an idle client connection stays open (keep it above the proxy's idle timeout)")
    p.add_argument("--reference", default=None, metavar="PATH",
                   help="the export's NAME_onnx/1/reference.json: /ready stays 503 until the served model reproduces "
                   "its reference vectors (checked at start and whenever Triton comes back; `bge-triton verify`)")
    p.add_argument("--verify-retry", type=float, default=d.verify_retry_s, metavar="SECONDS",
                   help="with --reference: check a failed verdict again after this many seconds")
    p.add_argument("--rerank-model", default=None, metavar="RERANKER", help="the Triton reranker (e.g. "
                   "bge_reranker): serves POST /rerank (TEI) and /v1/rerank (Cohere, Jina); none when not set")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="the gateway's log level")
    return p


def triton_target(text: str) -> str:
    """--url as the gRPC target the SDK dials: HOST:PORT (also grpc://HOST:PORT), or a dns:/// style target."""
    if text.startswith(GRPC_TARGETS):
        return text
    url = flags.server_url(text)
    if url.protocol != "grpc":
        raise InputError(f"--url {text}: the gateway talks to Triton over gRPC; give HOST:PORT of Triton's gRPC "
                         "port (8001), e.g. --url 127.0.0.1:8001")
    return url.address


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """The one settings object of this command."""
    return GatewaySettings(
        triton=triton_target(args.url), model=args.model, served_names=tuple(args.served_model_name), host=args.host,
        port=args.port, tokenizer=args.tokenizer, model_repository=args.model_repository,
        api_keys=load_keys(args.api_key, args.api_keys_file), unsafe_no_auth=args.unsafe_no_auth,
        rate_limit=args.rate_limit, rate_burst=args.rate_burst, max_body_bytes=args.max_body_bytes,
        max_inputs=args.max_inputs, max_in_flight=args.max_in_flight, timeout_s=args.timeout,
        triton_attempts=args.triton_attempts, query_priority=args.query_priority,
        passage_priority=args.passage_priority, query_instruction=args.query_instruction,
        canary_interval_s=args.canary_interval, ready_max_age_s=args.ready_max_age, log_level=args.log_level,
        micro_batch=not args.no_micro_batch, micro_batch_wait_s=args.micro_batch_wait_ms / 1e3,
        keep_alive_s=args.keep_alive, max_input_chars=args.max_input_chars, parse_workers=args.parse_workers,
        reference=_reference(args.reference), verify_retry_s=args.verify_retry,
        rerank_model=args.rerank_model)


def _reference(path: str | None) -> str | None:
    """--reference, read once here: a missing or unreadable file stops the gateway at start with the reason."""
    if path is None:
        return None
    from bge_triton.verify import VerifyError, load_reference

    try:
        load_reference(path)
    except VerifyError as err:
        raise InputError(f"--reference {path}: {err}") from None
    return path

"""The sans-I/O core shared by the sync and async clients: settings, the protocol-neutral request
(InferCall), error mapping and the check of the server's model config.

Nothing here opens a socket; client/wire.py turns an InferCall into each protocol's bytes and reads
the answers, the transports (client/transport.py) do the I/O.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from google.protobuf import json_format
from numpy.typing import NDArray
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.client.errors import InputError, ModelConfigError, classify
from bge_triton.client.retry import RetryPolicy

__all__ = [
    "BGE_QUERY_INSTRUCTION",
    "DEFAULT_BUCKETS",
    "ClientSettings",
    "Embedded",
    "Timed",
    "Timing",
    "Utf8",
    "InferCall",
    "ModelSpec",
    "chunk_slices",
    "classify",
    "config_from_json",
    "prepare_texts",
    "text_call",
    "tensor_call",
    "validate_model_config",
]

BGE_QUERY_INSTRUCTION = "为这个句子生成表示以用于检索相关文章："
DEFAULT_BUCKETS: tuple[int, ...] = (32, 64, 128, 256, 512)
CANARY_TEXT = "canary 健康检查"  # health() embeds it: readiness alone misses a dead python stub
TEXT_INPUT, IDS_INPUT, MASK_INPUT, OUTPUT = "text", "input_ids", "attention_mask", "embedding"
TOKEN_COUNT = "token_count"  # text endpoint output: tokens of each text as embedded ([CLS]/[SEP] in, truncated)
# text endpoint output INT64 [rows, 3]: the request's tokenization, queue and inference microseconds (every row
# the same); docs/reliability.md, "Request parameters and timing". An endpoint that declares it also reads the
# request parameter `truncation_direction` ("right" = cut the end, "left" = cut the start): both came together.
TIMING = "timing_us"
DIRECTIONS = ("right", "left")
_DTYPE = {mc.TYPE_STRING: "TYPE_STRING", mc.TYPE_INT64: "TYPE_INT64", mc.TYPE_FP32: "TYPE_FP32",
          mc.TYPE_INT32: "TYPE_INT32"}


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    """Everything a client needs, built once from arguments or CLI flags and passed down."""

    url: str | None = None
    model: str = "bge_large_zh"
    protocol: str = "grpc"
    mode: str = "text"
    timeout_s: float = 10.0
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    tokenizer: str | None = None
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_length: int | None = None
    truncate: bool = True
    query_instruction: str | None = BGE_QUERY_INSTRUCTION
    expected_dim: int | None = None
    rerank_model: str = "bge_reranker"  # the reranker's text-pair endpoint that rerank() calls

    def __post_init__(self) -> None:
        if self.protocol not in ("grpc", "http"):
            raise InputError(f"protocol={self.protocol!r}: use 'grpc' (default) or 'http'")
        if self.mode not in ("text", "tensor"):
            raise InputError(f"mode={self.mode!r}: use 'text' (server tokenizes) or 'tensor'")
        if self.mode == "tensor" and not self.tokenizer:
            raise InputError("mode='tensor' needs tokenizer=<dir with tokenizer.json or hub id>, "
                             "e.g. the exporter's MODEL_REPOSITORY/<model>/1/tokenizer")
        if self.timeout_s <= 0:
            raise InputError(f"timeout_s={self.timeout_s}: must be > 0 seconds")
        if not self.buckets or any(int(b) <= 0 for b in self.buckets):
            raise InputError(f"buckets={self.buckets!r}: give positive token lengths, e.g. (32, 64, 128)")
        object.__setattr__(self, "buckets", tuple(sorted({int(b) for b in self.buckets})))
        if self.url is None:
            object.__setattr__(self, "url", "127.0.0.1:8001" if self.protocol == "grpc" else "127.0.0.1:8000")
        if str(self.url).startswith(("http://", "https://", "grpc://")):
            raise InputError(f"url={self.url!r}: give host:port without a scheme, e.g. 127.0.0.1:8001")

    @property
    def target_model(self) -> str:
        """The Triton model the client calls: NAME (text mode) or NAME_onnx (tensor mode)."""
        return self.model if self.mode == "text" else f"{self.model}_onnx"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the client learned from the server's model config at connect."""

    name: str
    mode: str
    dim: int
    max_batch_size: int
    parameters: dict[str, str]
    token_counts: bool = False  # the model answers each text's token count (text endpoint `token_count`)
    timings: bool = False  # the model answers `timing_us` and reads `truncation_direction` (text endpoint)

    @property
    def max_length(self) -> int | None:
        """The text endpoint's token limit (config parameter `max_length`), if it declares one."""
        value = self.parameters.get("max_length", "")
        return int(value) if value.isdigit() else None


@dataclasses.dataclass(frozen=True)
class InferCall:
    """One inference request, protocol-neutral: model, named numpy inputs, request parameters."""

    model: str
    inputs: tuple[tuple[str, str, NDArray[Any]], ...]  # (name, Triton datatype, array)
    parameters: dict[str, Any]
    rows: int
    priority: int = 0  # Triton priority level (1 = highest; 0 = the model's default)
    outputs: tuple[str, ...] = (OUTPUT,)  # the outputs requested


class Embedded(NamedTuple):
    """Embeddings and the token count of each text as the model embedded it (special tokens included,
    after truncation): what `usage` reports. `vectors, counts = await client.embed_with_counts(...)`."""

    vectors: NDArray[Any]  # float32 [n, dim]
    token_counts: NDArray[Any]  # int32 [n]


class Timing(NamedTuple):
    """Where the time of one embed call went, in seconds, as the text endpoint measured it: tokenizing,
    waiting in its queue, in the encoder; total = the whole call as this client saw it (network included).
    A call split into several requests (over max_batch_size) reports each part's largest (they run at once)."""

    tokenization_s: float
    queue_s: float
    inference_s: float
    total_s: float


class Timed(NamedTuple):
    """embed_with_timing's result: Embedded's two arrays and the call's Timing."""

    vectors: NDArray[Any]  # float32 [n, dim]
    token_counts: NDArray[Any]  # int32 [n]
    timing: Timing


def config_from_json(payload: dict[str, Any]) -> mc.ModelConfig:
    """Parse the HTTP endpoint's JSON model config with Triton's own protobuf schema."""
    payload = payload.get("config", payload)
    try:
        return json_format.ParseDict(payload, mc.ModelConfig(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ModelConfigError(f"server returned a model config the schema cannot parse: {exc}") from exc


def _describe(io: Any) -> str:
    return f"'{io.name}' {_DTYPE.get(io.data_type, mc.DataType.Name(io.data_type))} dims {list(io.dims)}"


def _expect_io(config: mc.ModelConfig, kind: str, name: str, dtype: int, dims: list[int] | None) -> Any:
    """Find input/output `name` and check its type and dims; returns the tensor config."""
    tensors = {t.name: t for t in getattr(config, kind)}
    want = f"'{name}' {_DTYPE[dtype]} dims {dims if dims is not None else '[DIM]'}"
    fix = ("Re-export with `python -m bge_triton.export` (contract: docs/architecture.md) "
           "or choose the matching mode= / model=.")
    if name not in tensors:
        have = ", ".join(_describe(t) for t in tensors.values()) or "none"
        raise ModelConfigError(f"model '{config.name}' has no {kind} {want}; it has {have}. {fix}")
    tensor = tensors[name]
    if tensor.data_type != dtype or (dims is not None and list(tensor.dims) != dims):
        raise ModelConfigError(f"model '{config.name}' {kind} is {_describe(tensor)}, "
                               f"the client sends/reads {want}. {fix}")
    return tensor


def validate_model_config(config: mc.ModelConfig, settings: ClientSettings) -> ModelSpec:
    """Check the server's config against what the client will send; raise ModelConfigError naming the fix."""
    if config.name and config.name != settings.target_model:
        raise ModelConfigError(f"asked for model '{settings.target_model}', the server answered with "
                               f"'{config.name}'; check model=")
    if config.max_batch_size < 1:
        raise ModelConfigError(f"model '{config.name}' has max_batch_size {config.max_batch_size}; the client "
                               "sends [n, ...] batches: set max_batch_size >= 1 in its config.pbtxt")
    if settings.mode == "text":
        _expect_io(config, "input", TEXT_INPUT, mc.TYPE_STRING, [1])
    else:
        _expect_io(config, "input", IDS_INPUT, mc.TYPE_INT64, [-1])
        _expect_io(config, "input", MASK_INPUT, mc.TYPE_INT64, [-1])
    out = _expect_io(config, "output", OUTPUT, mc.TYPE_FP32, None)
    if len(out.dims) != 1 or out.dims[0] < 1:
        raise ModelConfigError(f"model '{config.name}' output {_describe(out)}: expected one fixed "
                               "dimension [DIM] (pooled embedding). Re-export the model.")
    dim = int(out.dims[0])
    if settings.expected_dim is not None and dim != settings.expected_dim:
        raise ModelConfigError(f"model '{config.name}' returns {dim}-dim embeddings, the caller expects "
                               f"{settings.expected_dim} (expected_dim=); point model= at the right model")
    params = {k: v.string_value for k, v in config.parameters.items()}
    counts = settings.mode == "tensor"  # tensor mode counts the tokens it sends (attention mask)
    if settings.mode == "text" and any(o.name == TOKEN_COUNT for o in config.output):
        _expect_io(config, "output", TOKEN_COUNT, mc.TYPE_INT32, [1])
        counts = True
    timings = False
    if settings.mode == "text" and any(o.name == TIMING for o in config.output):
        _expect_io(config, "output", TIMING, mc.TYPE_INT64, [3])
        timings = True
    return ModelSpec(config.name or settings.target_model, settings.mode, dim, int(config.max_batch_size), params,
                     counts, timings)


class Utf8(bytes):
    """A text its caller already encoded as valid UTF-8 (the gateway parses large bodies in a worker process
    and hands over bytes, not str: no second decode on its event loop). Plain bytes stay refused."""

    __slots__ = ()


def prepare_texts(texts: Sequence[str | Utf8] | str, instruction: str | None = None) -> list[str | Utf8]:
    """Validate the caller's texts (a list of non-empty str, or Utf8) and prepend the query instruction."""
    if isinstance(texts, (str, bytes)):
        raise InputError("texts must be a list of strings, got one str; wrap it: [text]")
    out: list[str | Utf8] = []
    for i, text in enumerate(texts):
        if not isinstance(text, (str, Utf8)):
            raise InputError(f"texts[{i}] is {type(text).__name__}, not str; pass decoded strings")
        if not text.strip():
            raise InputError(f"texts[{i}] is empty or whitespace; drop empty texts before embedding")
        if instruction:
            text = instruction + text if isinstance(text, str) else Utf8(instruction.encode("utf-8") + text)
        out.append(text)
    return out


def chunk_slices(n: int, max_batch: int) -> list[slice]:
    """Split n rows into consecutive slices of at most max_batch (the server's max_batch_size)."""
    return [slice(i, min(i + max_batch, n)) for i in range(0, n, max_batch)]


def text_call(model: str, texts: Sequence[str | Utf8], truncate: bool, counts: bool = False,
              direction: str | None = None, timing: bool = False) -> InferCall:
    """Text mode: BYTES [n, 1] utf-8 strings (Utf8 passes as it is) to the text endpoint, with the `truncate`
    parameter and, when given, `truncation_direction`; counts / timing: ask for `token_count` / `timing_us` too."""
    encoded: list[bytes] = []
    for i, text in enumerate(texts):
        if isinstance(text, Utf8):
            encoded.append(text)
            continue
        try:
            encoded.append(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InputError(f"text {i} is not valid UTF-8 text ({exc.reason} at position {exc.start}, "
                             f"e.g. a lone surrogate {text[exc.start]!r}): fix the string before sending") from None
    arr = np.empty((len(encoded), 1), dtype=np.object_)
    arr[:, 0] = encoded
    parameters: dict[str, Any] = {"truncate": bool(truncate)}
    if direction is not None:
        if direction not in DIRECTIONS:
            raise InputError(f"truncation_direction={direction!r}: use 'right' (cut the end) or 'left' (cut the start)")
        parameters["truncation_direction"] = direction
    outputs = (OUTPUT, *((TOKEN_COUNT,) if counts else ()), *((TIMING,) if timing else ()))
    return InferCall(model, ((TEXT_INPUT, "BYTES", arr),), parameters, len(texts), outputs=outputs)


def tensor_call(model: str, input_ids: NDArray[Any], attention_mask: NDArray[Any]) -> InferCall:
    """Tensor mode: padded INT64 [n, L] ids and mask to the encoder."""
    ids = np.ascontiguousarray(input_ids, dtype=np.int64)
    mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
    return InferCall(model, ((IDS_INPUT, "INT64", ids), (MASK_INPUT, "INT64", mask)), {}, ids.shape[0])

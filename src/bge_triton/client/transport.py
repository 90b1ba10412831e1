"""The I/O edge: four thin adapters (gRPC / HTTP x sync / asyncio).

Both gRPC adapters call grpc's generated stub for Triton's service with the request client.wire builds
(see GrpcSync, GrpcAsync), sync HTTP urllib3's keep-alive pool (client.http1, see HttpSync); asyncio HTTP
wraps tritonclient.http.aio.

Each adapter exposes the same four calls - model_config, infer, ready, close - with a per-call
timeout. Sync HTTP raises the kit's own Timeout / ServerUnavailable; the others let their library's
exceptions escape untouched, and client.errors.classify maps them (gRPC DEADLINE_EXCEEDED and asyncio's
timeout become Timeout there).
"""
from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, triton_to_np_dtype

from bge_triton.client.core import ClientSettings, InferCall, config_from_json
from bge_triton.client.errors import InputError
from bge_triton.client.wire import build_inputs, build_outputs, custom_parameters, grpc_request, http_request

__all__ = ["make_sync_transport", "make_async_transport"]

# tritonclient's own defaults plus a capped reconnect backoff: after a server restart the same
# client reconnects within about a second instead of grpc's default (up to 120 s).
GRPC_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.keepalive_time_ms", 2**31 - 1),
    ("grpc.keepalive_timeout_ms", 20000),
    ("grpc.keepalive_permit_without_calls", False),
    ("grpc.http2.max_pings_without_data", 2),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class GrpcSync:
    """grpc's generated stub for Triton's service, on one channel: thread-safe; deadlines per call.

    infer sends the ModelInferRequest that client.wire.grpc_request builds straight from the InferCall:
    tritonclient's InferInput objects cost about 0.1-0.2 ms of client CPU per call, and a one-text call
    at quiet hours pays all of it. RpcErrors become tritonclient's InferenceServerException through its
    own get_error_grpc, so client.errors classifies them as for every other adapter.
    """

    def __init__(self, url: str) -> None:
        import grpc
        import tritonclient.grpc as mod
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.mod = mod
        self._grpc = grpc
        self._pb = service_pb2
        self._channel = grpc.insecure_channel(url, options=GRPC_CHANNEL_ARGS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def _call(self, method: str, request: Any, timeout_s: float) -> Any:
        from tritonclient.grpc._utils import get_error_grpc

        try:
            return getattr(self._stub, method)(request, timeout=timeout_s)
        except self._grpc.RpcError as exc:
            raise get_error_grpc(exc) from None

    def model_config(self, name: str, timeout_s: float) -> mc.ModelConfig:
        return self._call("ModelConfig", self._pb.ModelConfigRequest(name=name), timeout_s).config

    def infer(self, call: InferCall, timeout_s: float) -> Any:
        return self.mod.InferResult(self._call("ModelInfer", grpc_request(self._pb, call), timeout_s))

    def ready(self, model: str | None, timeout_s: float) -> bool:
        if model is None:
            return bool(self._call("ServerReady", self._pb.ServerReadyRequest(), timeout_s).ready)
        return bool(self._call("ModelReady", self._pb.ModelReadyRequest(name=model), timeout_s).ready)

    def close(self) -> None:
        self._channel.close()


class HttpSync:
    """Triton's HTTP/REST protocol on urllib3's keep-alive pool (client.http1); thread-safe (each call in
    flight holds its own connection); deadlines per call (bge_triton.errors.Timeout when one passes).

    Sends the body client.wire.http_request builds (tritonclient.http's bytes, unit-tested) and reads
    the answer with HttpInferResult, with no per-call objects beyond those. Error answers become
    tritonclient's InferenceServerException with the HTTP status, as tritonclient.http raises them, so
    client.errors classifies them as for every other adapter.
    """

    def __init__(self, url: str) -> None:
        from bge_triton.client.http1 import HttpPool

        host, _, port = url.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"url={url!r}: give host:port, e.g. 127.0.0.1:8000")
        self.conn = HttpPool(host.strip("[]"), int(port))
        self._infer_paths: dict[str, str] = {}

    def _get(self, path: str, timeout_s: float) -> Any:
        return self.conn.request("GET", path, timeout_s=timeout_s)

    def _raise_for(self, response: Any) -> None:
        """tritonclient.http's error for a non-200 answer: the server's `error` text and the status."""
        if response.status == 200:
            return
        try:
            msg = json.loads(response.body)["error"] if response.body else "empty response from the server"
        except (ValueError, KeyError, TypeError):
            msg = response.body[:200].decode("utf-8", "replace")
        raise InferenceServerException(msg=msg, status=str(response.status))

    def model_config(self, name: str, timeout_s: float) -> mc.ModelConfig:
        response = self._get(f"/v2/models/{quote(name)}/config", timeout_s)
        self._raise_for(response)
        return config_from_json(json.loads(response.body))

    def infer(self, call: InferCall, timeout_s: float) -> Any:
        body, header_length = http_request(call)
        path = self._infer_paths.get(call.model)
        if path is None:
            path = self._infer_paths[call.model] = f"/v2/models/{quote(call.model)}/infer"
        response = self.conn.request("POST", path, body,
                                     {"Inference-Header-Content-Length": str(header_length)}, timeout_s)
        self._raise_for(response)
        return HttpInferResult(response.body, response.headers)

    def ready(self, model: str | None, timeout_s: float) -> bool:
        path = "/v2/health/ready" if model is None else f"/v2/models/{quote(model)}/ready"
        return bool(self._get(path, timeout_s).status == 200)

    def close(self) -> None:
        self.conn.close()


_WIRE_DTYPES: dict[str, np.dtype[Any]] = {}  # Triton datatype -> little-endian numpy dtype (binary outputs)


class HttpInferResult:
    """An HTTP infer response: `as_numpy(name)` as tritonclient.http.InferResult reads it (JSON header,
    then each binary output's bytes in order), without the classes tritonclient builds per response."""

    def __init__(self, body: bytes, headers: Mapping[str, str]) -> None:
        encoding = headers.get("content-encoding")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        length = headers.get("inference-header-content-length")
        split = len(body) if length is None else int(length)
        self._result = json.loads(body[:split])
        self._buffer = memoryview(body)[split:]

    def as_numpy(self, name: str) -> np.ndarray[Any, Any] | None:
        """The output `name` as a numpy array (None if the response has no such output)."""
        offset = 0
        for output in self._result.get("outputs", []):
            size = (output.get("parameters") or {}).get("binary_data_size")
            if output["name"] != name:
                offset += size or 0
                continue
            shape, dtype = output["shape"], output["datatype"]
            if size is None:  # sent as JSON data
                return np.array(output["data"], dtype=triton_to_np_dtype(dtype)).reshape(shape)
            raw = self._buffer[offset:offset + size]
            if dtype == "BYTES":
                strings: np.ndarray[Any, Any] = deserialize_bytes_tensor(bytes(raw))
                return strings.reshape(shape)
            np_dtype = _WIRE_DTYPES.get(dtype)
            if np_dtype is None:
                np_dtype = _WIRE_DTYPES[dtype] = np.dtype(triton_to_np_dtype(dtype)).newbyteorder("<")
            return np.frombuffer(raw, dtype=np_dtype).reshape(shape)
        return None


class GrpcAsync:
    """grpc.aio on the generated stub, one channel; deadlines per call. The asyncio twin of GrpcSync:
    the same directly built ModelInferRequest (no InferInput objects), the same error conversion."""

    def __init__(self, url: str) -> None:
        import grpc
        import grpc.aio
        import tritonclient.grpc as mod
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.mod = mod
        self._grpc = grpc
        self._pb = service_pb2
        self._channel = grpc.aio.insecure_channel(url, options=GRPC_CHANNEL_ARGS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def _call(self, method: str, request: Any, timeout_s: float) -> Any:
        from tritonclient.grpc._utils import get_error_grpc

        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s)
        except self._grpc.RpcError as exc:
            raise get_error_grpc(exc) from None

    async def model_config(self, name: str, timeout_s: float) -> mc.ModelConfig:
        return (await self._call("ModelConfig", self._pb.ModelConfigRequest(name=name), timeout_s)).config

    async def infer(self, call: InferCall, timeout_s: float) -> Any:
        return self.mod.InferResult(await self._call("ModelInfer", grpc_request(self._pb, call), timeout_s))

    async def ready(self, model: str | None, timeout_s: float) -> bool:
        if model is None:
            return bool((await self._call("ServerReady", self._pb.ServerReadyRequest(), timeout_s)).ready)
        return bool((await self._call("ModelReady", self._pb.ModelReadyRequest(name=model), timeout_s)).ready)

    async def close(self) -> None:
        await self._channel.close()


class HttpAsync:
    """tritonclient.http.aio (aiohttp): deadlines through asyncio.wait_for."""

    def __init__(self, url: str, timeout_s: float) -> None:
        import tritonclient.http as mod

        self.mod = mod
        self.url = url
        self.timeout_s = timeout_s
        self.client: Any = None  # aiohttp needs a running loop: created on first use

    def _client(self) -> Any:
        if self.client is None:
            import tritonclient.http.aio as aio

            self.client = aio.InferenceServerClient(url=self.url, conn_timeout=max(self.timeout_s, 1.0))
        return self.client

    async def model_config(self, name: str, timeout_s: float) -> mc.ModelConfig:
        return config_from_json(await asyncio.wait_for(self._client().get_model_config(name), timeout_s))

    async def infer(self, call: InferCall, timeout_s: float) -> Any:
        coro = self._client().infer(call.model, build_inputs(self.mod, call), outputs=build_outputs(self.mod,
                                                                                                    call.outputs),
                                    parameters=custom_parameters(call), priority=call.priority)
        return await asyncio.wait_for(coro, timeout_s)

    async def ready(self, model: str | None, timeout_s: float) -> bool:
        coro = self._client().is_server_ready() if model is None else self._client().is_model_ready(model)
        return bool(await asyncio.wait_for(coro, timeout_s))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None


def make_sync_transport(settings: ClientSettings) -> GrpcSync | HttpSync:
    """The sync adapter for settings.protocol."""
    url = _url(settings)
    return GrpcSync(url) if settings.protocol == "grpc" else HttpSync(url)


def make_async_transport(settings: ClientSettings) -> GrpcAsync | HttpAsync:
    """The asyncio adapter for settings.protocol."""
    url = _url(settings)
    return GrpcAsync(url) if settings.protocol == "grpc" else HttpAsync(url, settings.timeout_s)


def _url(settings: ClientSettings) -> str:
    if not settings.url:  # ClientSettings fills the protocol's default port; a bare settings object may not
        raise InputError("url is not set: give host:port, e.g. 127.0.0.1:8001 (gRPC) or 127.0.0.1:8000 (HTTP)")
    return settings.url

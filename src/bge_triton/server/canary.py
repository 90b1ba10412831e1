"""Canary inferences: a model is healthy only if it answers a real request, not because /ready says so.

Triton 2.51 keeps reporting a python model ready after its stub died; every request then fails fast
("Stub process ... is not healthy"). A canary is one tiny request per model, built from the model's own
config (a short text for BYTES inputs, two tokens for integer inputs), sent over HTTP/JSON with urllib so
it needs nothing but the standard library.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import NamedTuple

CANARY_TEXT = "canary 健康检查"
INT_TYPES = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}


class CanaryResult(NamedTuple):
    """One model's canary: ok, the round trip in ms, and the server's error message when not ok."""

    model: str
    ok: bool
    ms: float
    error: str = ""


def _post(url: str, body: dict | None, timeout_s: float) -> dict:
    data = b"{}" if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


def _get(url: str, timeout_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def canary_inputs(metadata: dict, max_batch_size: int) -> list[dict]:
    """The JSON inputs of one minimal request for a model (from /v2/models/<m> metadata and its batch size)."""
    inputs = []
    for spec in metadata.get("inputs", []):
        dims = [int(d) for d in spec["shape"]]
        if max_batch_size > 0:
            dims = dims[1:]  # metadata shapes start with the batch dimension (-1)
        shape = ([1] if max_batch_size > 0 else []) + [2 if d < 0 else d for d in dims]
        count = 1
        for d in shape:
            count *= d
        dtype = spec["datatype"]
        if dtype == "BYTES":
            data: list = [CANARY_TEXT] * count
        elif dtype in INT_TYPES:
            data = [1] * count  # id 1 and mask 1: valid for any vocabulary
        else:
            data = [0.0] * count
        inputs.append({"name": spec["name"], "shape": shape, "datatype": dtype, "data": data})
    return inputs


def canary(http_url: str, model: str, timeout_s: float = 5.0) -> CanaryResult:
    """Send one canary request to `model` at `http_url` (e.g. http://127.0.0.1:8000)."""
    base = http_url.rstrip("/")
    start = time.perf_counter()
    try:
        metadata = _get(f"{base}/v2/models/{model}", timeout_s)
        config = _get(f"{base}/v2/models/{model}/config", timeout_s)
        body = {"inputs": canary_inputs(metadata, int(config.get("max_batch_size", 0)))}
        answer = _post(f"{base}/v2/models/{model}/infer", body, timeout_s)
        if not answer.get("outputs"):
            raise ValueError(f"answer without outputs: {str(answer)[:200]}")
    except urllib.error.HTTPError as exc:
        message = exc.read().decode(errors="replace")[:300]
        return CanaryResult(model, False, (time.perf_counter() - start) * 1e3, f"HTTP {exc.code}: {message}")
    except (OSError, ValueError) as exc:
        return CanaryResult(model, False, (time.perf_counter() - start) * 1e3, f"{type(exc).__name__}: {exc}")
    return CanaryResult(model, True, (time.perf_counter() - start) * 1e3)


def loaded_models(http_url: str, timeout_s: float = 5.0) -> list[str]:
    """Names of the models the server reports READY in its repository index."""
    index = _post(f"{http_url.rstrip('/')}/v2/repository/index", None, timeout_s)
    return sorted(m["name"] for m in index if m.get("state") == "READY")


def canary_all(http_url: str, timeout_s: float = 5.0) -> list[CanaryResult]:
    """A canary for every READY model of the server."""
    return [canary(http_url, m, timeout_s) for m in loaded_models(http_url, timeout_s)]

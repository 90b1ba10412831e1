"""Full-stack side of the stack benchmark: tritonclient gRPC load on the text endpoint, and its metrics.

`saturate` keeps many requests in flight (asyncio gRPC client, one process) and counts the texts
completed inside a measurement window after a warm-up; `Sequential` sends one request at a time
for latency. `scrape_kit_metrics` reads the endpoint's Prometheus counters from the metrics port.
"""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

from bge_triton.errors import ServerUnavailable

_METRIC = re.compile(r'^(kit_[a-z_]+)\{([^}]*)\}\s+([0-9.eE+-]+)\s*$')


def scrape_kit_metrics(metrics_url: str, model: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The text endpoint's kit_* counters for one model, from Triton's Prometheus endpoint."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError as exc:
        raise ServerUnavailable(f"cannot read {metrics_url}: {exc}; is the server up?") from exc
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and f'model="{model}"' in m.group(2):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def steady_rate(finished: list[tuple[float, int]], window_s: float, gap_s: float = 0.01) -> float:
    """Texts/s from (completion time, texts) inside a window, over whole batch cycles.

    A closed loop at saturation completes in bursts (one Triton batch answers many requests at
    once), so count / window is off by up to a burst. Completions closer than gap_s form one
    burst; the rate is the texts of bursts 2..k over the time from burst 1 to burst k.
    """
    if not finished:
        return 0.0
    finished = sorted(finished)
    bursts = [[finished[0][0], finished[0][1]]]  # [time of the burst's last completion, texts]
    for end, n in finished[1:]:
        if end - bursts[-1][0] <= gap_s:
            bursts[-1][0], bursts[-1][1] = end, bursts[-1][1] + n
        else:
            bursts.append([end, n])
    span = bursts[-1][0] - bursts[0][0]
    if len(bursts) < 3 or span <= 0:
        return sum(n for _, n in finished) / window_s
    return sum(n for _, n in bursts[1:]) / span


def text_array(texts: list[str]) -> np.ndarray:
    """The `text` input tensor [n, 1] BYTES of one request."""
    return np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)


@dataclass(frozen=True)
class SaturationResult:
    """Texts/s completed inside the window, with request errors and the client's own CPU use."""

    texts_per_s: float
    texts: int
    requests: int
    errors: int
    window_s: float
    client_cores: float  # CPU seconds of this (client) process per wall second in the window


async def _saturate(url: str, model: str, requests: list[np.ndarray], concurrency: int,
                    warm_s: float, window_s: float) -> SaturationResult:
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import InferenceServerException

    client = grpcaio.InferenceServerClient(url)
    inputs = []
    for arr in requests:  # serialise once: the load generator should cost the server's cores little
        inp = grpcaio.InferInput("text", list(arr.shape), "BYTES")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    outputs = [grpcaio.InferRequestedOutput("embedding")]
    start = time.perf_counter()
    t0, t1 = start + warm_s, start + warm_s + window_s
    counted = {"texts": 0, "requests": 0, "errors": 0}
    finished: list[tuple[float, int]] = []
    cpu = {}

    async def worker(w: int) -> None:
        i = w
        while True:
            now = time.perf_counter()
            if now >= t1:
                return
            inp = inputs[i % len(inputs)]
            i += concurrency
            try:
                await client.infer(model, [inp], outputs=outputs)
                ok = True
            except InferenceServerException:
                ok = False
            end = time.perf_counter()
            if t0 <= end < t1:
                if ok:
                    counted["texts"] += inp.shape()[0]
                    counted["requests"] += 1
                    finished.append((end, inp.shape()[0]))
                else:
                    counted["errors"] += 1

    async def meter() -> None:  # this process's CPU time over the window (the client's own cost)
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        cpu["t0"] = time.process_time()
        await asyncio.sleep(max(0.0, t1 - time.perf_counter()))
        cpu["t1"] = time.process_time()

    try:
        await asyncio.gather(meter(), *(worker(w) for w in range(concurrency)))
    finally:
        await client.close()
    cpu_s = cpu["t1"] - cpu["t0"]
    return SaturationResult(steady_rate(finished, window_s), counted["texts"], counted["requests"],
                            counted["errors"], window_s, cpu_s / window_s)


def saturate(url: str, model: str, texts: list[str], per_request: int, concurrency: int,
             warm_s: float, window_s: float) -> SaturationResult:
    """Closed-loop load: `concurrency` requests of `per_request` texts in flight, cycling over texts."""
    requests = [text_array(texts[k:k + per_request]) for k in range(0, len(texts), per_request)]
    return asyncio.run(_saturate(url, model, requests, concurrency, warm_s, window_s))


class Sequential:
    """One request in flight at a time (sync gRPC client): latency of single texts."""

    def __init__(self, url: str, model: str):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.outputs = [grpcclient.InferRequestedOutput("embedding")]

    def latency_ms(self, text: str) -> float:
        """Client-side latency of one single-text request (building the request included)."""
        start = time.perf_counter()
        inp = self._grpc.InferInput("text", [1, 1], "BYTES")
        inp.set_data_from_numpy(text_array([text]))
        self.client.infer(self.model, [inp], outputs=self.outputs)
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        self.client.close()


class SdkSequential:
    """One request in flight through the kit's own client SDK (client.EmbeddingClient, sync), one text
    per call: what a service embedding a query at quiet hours pays, client library included."""

    def __init__(self, url: str, model: str, protocol: str):
        from bge_triton.client.sync import EmbeddingClient

        self.client = EmbeddingClient(url, model=model, protocol=protocol).connect()

    def latency_ms(self, text: str) -> float:
        """Client-side latency of one single-text embed_documents call."""
        start = time.perf_counter()
        self.client.embed_documents([text])
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        self.client.close()

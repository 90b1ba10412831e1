"""What every chaos scenario stands on: loopback ports, a server it owns, process-tree RSS and sockets,
and raw tritonclient requests (below the kit client, so the server's own checks are exercised).

Every server here is started by the scenario that uses it and stopped by its pid; nothing else is
ever signalled.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bge_triton.loadtest import harness
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import LocalServer, ServerSettings

PORT_RANGE = range(18200, 18300)  # the chaos scenarios' own ports (bench: 18100-18199)



def server_settings(repository: Path, state_dir: Path, variant: CpuVariant | None = None,
                    ports: Sequence[int] | None = None, **kwargs: Any) -> ServerSettings:
    """harness.server_settings on the chaos scenarios' own ports."""
    return harness.server_settings(repository, state_dir, variant, ports, PORT_RANGE, **kwargs)


def start_server(repository: Path, state_dir: Path, variant: CpuVariant | None = None,
                 ports: Sequence[int] | None = None, **kwargs: Any) -> LocalServer:
    """harness.start_server on the chaos scenarios' own ports: a server the caller owns and stops."""
    return harness.start_server(repository, state_dir, variant, ports, PORT_RANGE, **kwargs)


def process_tree(pid: int) -> list[psutil.Process]:
    """The server process and its children (the python backend stubs)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss_mb(pid: int) -> float:
    """Resident memory of tritonserver + its stub children, in MiB."""
    total = 0
    for proc in process_tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20


def stub_pids(pid: int) -> dict[int, str]:
    """pid -> command line of the python backend stubs under a tritonserver pid."""
    out = {}
    for proc in process_tree(pid)[1:]:
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "triton_python_backend_stub" in cmd:
            out[proc.pid] = cmd
    return out


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket held by the server process tree."""
    found = []
    for proc in process_tree(pid):
        try:
            conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return sorted(set(found))


def wait_until(predicate, timeout_s: float, step_s: float = 0.1) -> float | None:
    """Seconds until predicate() is true, or None after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(step_s)
    return None


# -- raw requests ---------------------------------------------------------------------------
@dataclass
class RawOutcome:
    """What one raw request ended in: ok (rows), or an error with its status and message."""

    ok: bool
    status: str = ""
    message: str = ""
    rows: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _module(protocol: str):
    if protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        import tritonclient.http as mod
    return mod


def raw_client(protocol: str, url: str):
    """A plain tritonclient client (gRPC or HTTP) for requests the kit client would refuse to build."""
    return _module(protocol).InferenceServerClient(url)


def raw_infer(client: Any, protocol: str, model: str, inputs: Sequence[tuple[str, str, np.ndarray]],
              parameters: dict | None = None, timeout_s: float = 30.0) -> RawOutcome:
    """Send named (name, datatype, array) inputs; never raises for a server answer."""
    from tritonclient.utils import InferenceServerException

    mod = _module(protocol)
    tensors = []
    for name, dtype, arr in inputs:
        t = mod.InferInput(name, list(arr.shape), dtype)
        if protocol == "http":
            t.set_data_from_numpy(arr, binary_data=True)
        else:
            t.set_data_from_numpy(arr)
        tensors.append(t)
    kwargs: dict[str, Any] = {"parameters": parameters} if parameters else {}
    if protocol == "grpc":
        kwargs["client_timeout"] = timeout_s
    start = time.monotonic()
    try:
        res = client.infer(model, tensors, **kwargs)
        emb = res.as_numpy("embedding")
        return RawOutcome(True, rows=0 if emb is None else int(emb.shape[0]), seconds=time.monotonic() - start)
    except InferenceServerException as exc:
        return RawOutcome(False, str(exc.status() or ""), exc.message() or str(exc),
                          seconds=time.monotonic() - start)


def text_array(texts: Sequence[str | bytes]) -> np.ndarray:
    """BYTES [n, 1]; str items are UTF-8 encoded, bytes items go as they are (invalid UTF-8 too)."""
    items = [t if isinstance(t, bytes) else t.encode("utf-8", "surrogatepass") for t in texts]
    return np.array(items, dtype=np.object_).reshape(-1, 1)

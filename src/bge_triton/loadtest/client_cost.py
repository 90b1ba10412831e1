"""`bge-triton bench client`: the sync HTTP transport's one-in-flight cost, urllib3 (now) against the hand-written
HTTP/1.1 client it replaced (read from git history: `--old-rev`), both as client.transport.HttpSync (same request
bytes, same decoder), side by side against a no-op python model on a local tritonserver: the difference is client
time. Blocks of calls take turns (ABBA). Writes client_http.md and client_http.csv."""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bge_triton.client.core import tensor_call
from bge_triton.client.transport import HttpSync
from bge_triton.errors import KitError
from bge_triton.loadtest import harness, report
from bge_triton.loadtest.costmodel import DEFAULT as DEFAULT_COST
from bge_triton.loadtest.stand import turns
from bge_triton.loadtest.stats import percentile
from bge_triton.paths import IMPORT_ROOT, REPORTS_DIR, STATE_DIR

OLD_REV = "1ea3cab"  # the last commit whose client/http1.py is the hand-written HTTP/1.1 client
FIELDS = ("client", "calls", "mean_us", "p50_us", "p99_us", "cpu_us_per_call")


def module_at(rev: str, path: str, name: str) -> types.ModuleType:
    """`path` (from the repository root) as committed at git revision `rev`, loaded as a throw-away module `name`
    (registered in sys.modules: dataclasses look their module up there)."""
    proc = subprocess.run(["git", "-C", str(IMPORT_ROOT.parent), "show", f"{rev}:{path}"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise KitError(f"cannot read {path} at {rev} ({proc.stderr.strip()[:200]}): run this from a git checkout of "
                       "bge-triton-kit with its history, or name another revision")
    module = sys.modules[name] = types.ModuleType(name)
    exec(compile(proc.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def measure(calls: Mapping[str, Callable[[int], Any]], block: int, rounds: int) -> list[dict[str, Any]]:
    """Per-call wall time and client CPU (this thread's) of each caller, blocks of `block` calls taking turns."""
    lat, cpu = asyncio.run(turns(calls, range(block * rounds), block, time.thread_time))
    return [{"client": name, "calls": len(xs), "mean_us": statistics.fmean(xs) * 1e3,
             "p50_us": percentile(xs, 50) * 1e3, "p99_us": percentile(xs, 99) * 1e3,
             "cpu_us_per_call": cpu[name] * 1e6 / len(xs)} for name, xs in lat.items()]


def write(rows: list[dict[str, Any]], out: Path, command: str, seq_len: int) -> list[Path]:
    new, old = rows
    ratio = {k: new[k] / old[k] for k in ("p50_us", "mean_us", "cpu_us_per_call")}
    lines = [f"Machine: {report.machine_line(os.getloadavg())}.  ",
             f"Load: one call in flight, `HttpSync.infer` of one [1, {seq_len}] INT64 request to a no-op python model "
             "(answers zeros at once): the server's share is the same for both rows, the difference is client time. "
             "Blocks of calls take turns (ABBA).", "",
             *report.table("client | calls | mean us | p50 us | p99 us | client CPU us / call",
                           ([r[k] if isinstance(r[k], str | int) else round(r[k]) for k in FIELDS] for r in rows)), "",
             f"urllib3 / hand-written: p50 {ratio['p50_us']:.2f}x, mean {ratio['mean_us']:.2f}x, client CPU "
             f"{ratio['cpu_us_per_call']:.2f}x ({new['p50_us'] - old['p50_us']:+.0f} us per call at p50)."]
    return [report.write_md(out / "client_http.md", command, "Sync HTTP transport: urllib3 against the hand-written "
                            "HTTP/1.1 client", lines), report.write_csv(rows, FIELDS, out / "client_http.csv", command)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bge-triton bench client", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=4000, help="calls per client (default 4000)")
    p.add_argument("--block", type=int, default=200, help="calls per turn (default 200)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens in the request (default 64)")
    p.add_argument("--old-rev", default=OLD_REV, help=f"git revision of the old client (default {OLD_REV})")
    p.add_argument("--out", type=Path, default=REPORTS_DIR / "client", help="report folder (default reports/client)")
    p.add_argument("--state-dir", type=Path, default=STATE_DIR / "client_cost", help="server state and repository")
    a = p.parse_args(argv)
    command = shlex.join(["bge-triton", "bench", "client", *(sys.argv[1:] if argv is None else argv)])
    repo = harness.build_repository(a.state_dir / "bench_repository", None, None, command)
    h = harness.Harness(repo, a.state_dir / "server", DEFAULT_COST).start()
    try:
        h.load(harness.NOOP)
        ids = np.arange(1, a.seq_len + 1, dtype=np.int64).reshape(1, a.seq_len)
        call = tensor_call(harness.NOOP, ids, np.ones_like(ids))
        # two HttpSync transports to the same server: urllib3 (as shipped) and the old hand-written connection
        old = HttpSync(h.live.http_url)
        old.conn = module_at(a.old_rev, "src/bge_triton/client/http1.py", "bge_triton_old_http1").Http1Connection(
            *h.host_port)  # the same request() contract
        transports = {"urllib3 (HttpSync now)": HttpSync(h.live.http_url), f"hand-written http1 ({a.old_rev})": old}
        calls = {name: (lambda _i, t=t: t.infer(call, 10.0)) for name, t in transports.items()}
        measure(calls, 50, 2)  # warm-up: connections open, code paths hot
        rows = measure(calls, a.block, max(2, round(a.calls / a.block)))
        for t in transports.values():
            t.close()
    finally:
        h.stop()
    for path in write(rows, a.out, command, a.seq_len):
        print(f"wrote {path}")
    return 0

"""The process-level pieces of the fault scenarios (loadtest.chaos, loadtest.soak): their ports, the closed-loop
capacity, a bounded wait, and the clean-up after a kill -9 of a server they started (never any other process)."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil

from bge_triton.loadtest import loadgen

PORT_RANGE = range(18200, 18300)  # the chaos scenarios' own ports (bench: 18100-18199)


async def capacity(call: Callable[[int], Awaitable[object]], seconds: float, users: int, pause_s: float) -> float:
    """Texts per second sustained closed-loop (loadgen.closed_loop) by `users` users."""
    t = time.monotonic()
    ok = await loadgen.closed_loop(call, users, lambda: time.monotonic() - t >= seconds, pause_s=pause_s)
    return ok / (time.monotonic() - t)


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> float | None:
    """Seconds until predicate() is true, or None after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(step_s)
    return None


def remove_orphan_shm(stubs: dict[int, str]) -> int:
    """Unlink the /dev/shm regions named on these (killed server's) stubs' command lines; returns how many."""
    names = {cmd.split()[2].lstrip("/") for cmd in stubs.values() if len(cmd.split()) > 2}
    left = [p for p in Path("/dev/shm").glob("*triton_python_backend_shm*") if p.name in names]
    for p in left:
        p.unlink(missing_ok=True)
    return len(left)


def kill_orphan_stubs(stubs: dict[int, str]) -> list[str]:
    """SIGKILL the stubs (pid -> command line) that outlived their killed server, never a pid now naming another
    process; returns the instance names killed."""
    killed = []
    for pid, cmd in stubs.items():
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE or " ".join(proc.cmdline()) != cmd:
                continue
        except psutil.NoSuchProcess:
            continue
        words = cmd.split()  # stub MODEL_PY SHM_REGION SIZE GROWTH PARENT_PID LIB IPC_KEY INSTANCE ...
        killed.append(words[8] if len(words) > 8 else words[1])
        os.kill(pid, signal.SIGKILL)
    return killed


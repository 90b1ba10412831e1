"""The faults of `bge-triton chaos` and `bge-triton bench soak`, defined once: kill -9 of a tritonserver the caller
started, kill -9 of its encoder's python stub, an overload spike of the offered rate; the clean-up after a kill and a
restart that keeps the killed server's ports (or says it could not); one outcome record (Outcome) and one definition
of recovered (judge). Only processes the caller started are signalled, each by its pid."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import psutil

from bge_triton.errors import PortInUse, ServerNotReady
from bge_triton.loadtest import harness, loadgen
from bge_triton.loadtest.stats import percentile, stub_pids
from bge_triton.server.launcher import LocalServer, ServerSettings

PORT_RANGE = range(18200, 18300)  # the fault scenarios' servers that are never restarted (bench: 18100-18199)
# Servers that are killed and restarted on their ports: a pool no other part of the kit picks from (launcher.free_ports'
# default is 18000-18499), so a server started while ours is down never takes its ports (a kill window is seconds).
RESTART_PORTS = range(18500, 18600)
KILL9_SERVER, KILL9_STUB, OVERLOAD_SPIKE = "kill9_server", "kill9_stub", "overload_spike"
FAULTS = (KILL9_SERVER, KILL9_STUB, OVERLOAD_SPIKE)
SAME_PORTS = "same ports"  # Outcome.restart of a restart that kept the killed server's ports
FAILED = 1e9  # the latency (s) a failed request stands for: beyond any threshold


# -- injection -------------------------------------------------------------------------------------------------------
def kill_server(pid: int) -> dict[int, str]:
    """kill -9 of a tritonserver the caller started, by its pid; its python stubs as they were (pid -> command line),
    for clean_up_after_kill."""
    stubs = stub_pids(pid)
    os.kill(pid, signal.SIGKILL)
    return stubs


def kill_stub(server_pid: int | None, model: str, every: bool = False) -> list[int]:
    """kill -9 of the python stub of one instance of `model` (each instance: every=True) under a tritonserver the
    caller started; the pids killed, lowest first. ServerNotReady when there is none to kill."""
    stubs = sorted(p for p, cmd in stub_pids(server_pid).items() if f"/{model}/" in cmd) if server_pid else []
    if not stubs:
        raise ServerNotReady(f"no python stub of {model} under tritonserver pid {server_pid}: is it (re)starting?")
    for pid in stubs if every else stubs[:1]:
        os.kill(pid, signal.SIGKILL)
    return stubs if every else stubs[:1]


class Rate:
    """An open loop's offered rate (requests/s, loadgen.poisson's rate()): `base`, times a factor during a spike."""

    def __init__(self, base: float) -> None:
        self.base, self.factor = base, 1.0

    def __call__(self) -> float:
        return self.base * self.factor

    async def spike(self, factor: float, seconds: float) -> None:
        """The overload spike: `factor` x the base rate for `seconds`, then the base again."""
        self.factor = factor
        try:
            await asyncio.sleep(seconds)
        finally:
            self.factor = 1.0


# -- after a kill ----------------------------------------------------------------------------------------------------
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


def remove_orphan_shm(stubs: dict[int, str]) -> int:
    """Unlink the /dev/shm regions named on these (killed server's) stubs' command lines; returns how many."""
    names = {cmd.split()[2].lstrip("/") for cmd in stubs.values() if len(cmd.split()) > 2}
    left = [p for p in Path("/dev/shm").glob("*triton_python_backend_shm*") if p.name in names]
    for p in left:
        p.unlink(missing_ok=True)
    return len(left)


def clean_up_after_kill(stubs: dict[int, str], wait_s: float = 15.0) -> dict:
    """Wait up to wait_s for a killed server's stubs to exit, kill those that outlive it, remove its /dev/shm."""
    exited = wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                        for p in stubs), wait_s)
    return {"stubs_exited_after_kill_s": exited, "stubs_outliving_server": kill_orphan_stubs(stubs),
            "shm_regions_left": remove_orphan_shm(stubs)}


def port_holders(ports: Sequence[int]) -> str:
    """Who listens on each of these loopback ports now ('18201: pid 4242 tritonserver'), for a restart's outcome."""
    found = []
    with contextlib.suppress(psutil.AccessDenied):
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
                name = "?"
                with contextlib.suppress(psutil.Error):
                    name = psutil.Process(c.pid).name() if c.pid else "a process of another user"
                found.append(f"{c.laddr.port}: pid {c.pid or '?'} {name}")
    return ", ".join(sorted(set(found))) or "none listening now"


class PortHold:
    """While a killed server is down, its ports bound here (SO_REUSEADDR, never listening: a client is refused as if
    nothing were there), so a server started meanwhile skips them (launcher.free_ports binds to test); released on
    exit, just before the restart binds them."""

    def __init__(self, ports: Sequence[int]) -> None:
        self.ports, self.held = tuple(ports), dict[int, socket.socket]()

    def grab(self) -> list[int]:
        """Bind the ports not held yet; those still taken (the dead server's stubs may keep them a while)."""
        for port in self.ports:
            if port in self.held:
                continue
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                self.held[port] = sock
            except OSError:
                sock.close()
        return [p for p in self.ports if p not in self.held]

    def __enter__(self) -> PortHold:
        self.grab()
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self.held.values():
            sock.close()
        self.held.clear()


def restart_on_same_ports(settings: ServerSettings) -> tuple[LocalServer | None, str]:
    """Start the killed server again on ITS ports, never others from a pool (its clients know only these): (server,
    SAME_PORTS), or (None, 'ports taken: ...') naming who holds them."""
    same = dataclasses.replace(settings, port_pool=None)  # a taken port is PortInUse, not a move elsewhere
    try:
        return harness.launch(same), SAME_PORTS
    except PortInUse as exc:
        ports = (same.http_port, same.grpc_port, same.metrics_port)
        return None, f"ports taken: {port_holders(ports)} ({str(exc).splitlines()[0]})"


# -- recovery --------------------------------------------------------------------------------------------------------
class Shot(NamedTuple):
    """One request: its scheduled send time, when its answer came (both in s on the scenario's clock), its outcome
    ("ok", errors.kind_of of the error, or "lost")."""

    sched: float
    done: float
    outcome: str


def window_p99s(shots: Sequence[Shot], t: float, width: float, n: int) -> list[tuple[float, int]]:
    """(p99 latency in s, count) of the requests scheduled in each of n `width` s windows from t; failures are inf."""
    lat: list[list[float]] = [[] for _ in range(n)]
    for s in shots:
        if s.sched >= t and (k := int((s.sched - t) // width)) < n:
            lat[k].append(s.done - s.sched if s.outcome == "ok" else FAILED)
    return [(math.inf if (p99 := percentile(b, 99)) >= FAILED / 1e3 else p99, len(b)) for b in lat]


def calm_p99(shots: Sequence[Shot], end: float) -> tuple[float, float]:
    """p99 of the successes scheduled before `end` and 'back to normal': 2x that, never under 50 ms."""
    base = percentile([s.done - s.sched for s in shots if s.outcome == "ok" and s.sched < end], 99)
    return base, (math.inf if math.isnan(base) else max(2.0 * base, 0.05))


def p99_back_after(shots: Sequence[Shot], t: float, threshold_s: float, width: float, until: float,
                   hold: int = 3, min_n: int = 5) -> float | None:
    """Seconds from t to the start of the first `width` s window (of those from t, ending by `until`) whose p99 is
    within threshold_s for `hold` windows running; a window of fewer than min_n requests is not normal."""
    normal = [n >= min_n and p99 <= threshold_s
              for p99, n in window_p99s(shots, t, width, max(0, int((until - t) / width + 1e-9)))]
    return next((k * width for k in range(len(normal) - hold + 1) if all(normal[k:k + hold])), None)


@dataclass
class Outcome:
    """One fault and what followed it: times in seconds from the fault (at_s on the scenario's clock)."""

    kind: str  # one of FAULTS
    at_s: float
    length_s: float = 0.0  # an overload spike's length
    pid: int = 0  # the process killed
    error: str = ""  # not injected: why
    restart: str = ""  # how the server came back: SAME_PORTS, "server up --watch", "ports taken: ...", "none: ..."
    ready_again_s: float | None = None
    first_ok_s: float | None = None  # the first success after the fault (its answer's time)
    p99_normal_s: float | None = None  # p99_back_after from the fault
    p99_normal_after_end_s: float | None = None  # ... from the fault's end (a spike's end)
    errors_after: int = 0  # errors and losses of the requests sent from the fault until `upto`
    lost_after: int = 0
    recovered: bool = False


def judge(o: Outcome, shots: Sequence[Shot], threshold_s: float, width_s: float, until_s: float,
          upto_s: float = math.inf) -> Outcome:
    """THE definition of recovered, for every fault: it was injected; a fault that takes the server (or a stub)
    down saw it ready again, on the address its clients know; a request succeeded after it; and the p99 of the
    requests sent after it (errors as infinitely slow) was within threshold_s for three width_s windows running,
    judged until until_s. Fills o's figures from the shots; upto_s bounds the errors counted (the next fault)."""
    t = o.at_s
    after = [x for x in shots if t <= x.sched < upto_s]
    o.first_ok_s = min((x.done - t for x in shots if x.outcome == "ok" and x.sched >= t), default=None)
    o.p99_normal_s = p99_back_after(shots, t, threshold_s, width_s, until_s)
    o.p99_normal_after_end_s = p99_back_after(shots, t + o.length_s, threshold_s, width_s, until_s)
    o.errors_after = sum(x.outcome not in ("ok", "lost") for x in after)
    o.lost_after = sum(x.outcome == "lost" for x in after)
    o.recovered = not o.error and (o.kind == OVERLOAD_SPIKE or o.ready_again_s is not None) \
        and o.first_ok_s is not None and o.p99_normal_s is not None
    return o


# -- waiting and measuring -------------------------------------------------------------------------------------------
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

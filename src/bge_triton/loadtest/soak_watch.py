"""The server side of the soak, run the way a user runs it: `python -m bge_triton.server up --watch 1` (the
watcher of server/__main__.py, whose `unhealthy()` canary decides restarts) over the committed BGE-Large-zh
configs, with the encoder on the costmodel executor (an emulated GPU) and a generated BGE-shaped vocabulary.

Only processes this module started are signalled: the watcher, its tritonserver, and that server's stubs.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bge_triton.errors import ServerNotReady
from bge_triton.loadtest.chaos_common import PORT_RANGE, stub_pids, tree_rss_mb
from bge_triton.paths import CANONICAL_REPOSITORY
from bge_triton.server.launcher import free_ports, log_tail

MODEL = "bge_large_zh"
ENCODER = f"{MODEL}_onnx"


def shipped_repository(out: Path) -> Path:
    """The committed configs and model.py files of bge_large_zh (+ _onnx), plus a tokenizer.json over the
    generated 21128-entry BGE-shaped vocab (each CJK character one token); no weights (costmodel encoder)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    from bge_triton.export.synthetic import build_vocab

    if out.exists():
        shutil.rmtree(out)
    for model in (MODEL, ENCODER):
        shutil.copytree(CANONICAL_REPOSITORY / model, out / model,
                        ignore=shutil.ignore_patterns("tokenizer", "*.onnx*", "export_report.json", "__pycache__"))
    tok_dir = out / MODEL / "1" / "tokenizer"
    tok_dir.mkdir(parents=True)
    vocab = {token: i for i, token in enumerate(build_vocab())}
    BertWordPieceTokenizer(vocab, lowercase=True, handle_chinese_chars=True).save(str(tok_dir / "tokenizer.json"))
    return out


def shm_regions() -> set[str]:
    """Python-backend shared-memory regions in /dev/shm (a SIGKILLed server cannot unlink its own)."""
    try:
        return {p.name for p in Path("/dev/shm").iterdir() if "triton_python_backend_shm" in p.name}
    except OSError:
        return set()


class Watcher:
    """`python -m bge_triton.server up --executor costmodel --watch S` as a child process; its stdout lines are
    kept with their monotonic arrival time (restarts: 'watch: restarting ...', 'watch: ready again ...')."""

    def __init__(self, repository: Path, state_dir: Path, watch_s: float = 1.0, ready_timeout_s: float = 300.0):
        self.http, self.grpc, self.metrics = free_ports(3, PORT_RANGE)
        self.state = Path(state_dir)
        self.cmd = [sys.executable, "-m", "bge_triton.server", "up", "--repository", str(repository),
                    "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
                    "--executor", "costmodel", "--state-dir", str(self.state), "--watch", str(watch_s),
                    "--ready-timeout", str(ready_timeout_s)]
        self.ready_timeout_s = ready_timeout_s
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None
        self.stubs_seen: dict[int, str] = {}  # every stub pid of our servers -> its command line
        self.old_logs: list[str] = []  # the tail of each replaced server's log

    @property
    def command(self) -> str:
        return "python -m bge_triton.server up --executor costmodel --watch " + self.cmd[self.cmd.index("--watch") + 1]

    def start(self) -> Watcher:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s + 30
        while not any("tritonserver ready" in ln for _, ln in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerNotReady("`" + " ".join(self.cmd) + "` did not come up:\n"
                                     + "".join(ln for _, ln in self.lines[-30:]))
            time.sleep(0.2)
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
            if "watch: restarting" in line:  # the old server's log, before the restart reopens the file
                self.old_logs.append(log_tail(self.state / "tritonserver.log", 30))

    def server_pid(self) -> int | None:
        """The tritonserver pid the watcher runs now, checked to be its child (None while it restarts)."""
        try:
            pid = int((self.state / "server.pid").read_text())
            proc = psutil.Process(pid)
            if self.proc is None or proc.ppid() != self.proc.pid or proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except (OSError, ValueError, psutil.NoSuchProcess):
            return None
        self.stubs_seen.update(stub_pids(pid))
        return pid

    def rss_mb(self) -> tuple[int, float]:
        """(server pid, RSS of tritonserver + its stubs in MiB); (0, nan) while no server runs."""
        pid = self.server_pid()
        return (pid, tree_rss_mb(pid)) if pid else (0, float("nan"))

    def kill_server(self) -> int:
        """SIGKILL the watcher's tritonserver (our grandchild); returns its pid."""
        pid = self.server_pid()
        if pid is None:
            raise ServerNotReady("no tritonserver to kill: the watcher is restarting it")
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_stub(self, model: str = ENCODER, every_instance: bool = False) -> int:
        """SIGKILL the python stub of one instance of `model` (or of each), children of the watcher's
        tritonserver; returns the first pid killed."""
        pid = self.server_pid()
        stubs = sorted(p for p, cmd in stub_pids(pid).items() if f"/{model}/" in cmd) if pid else []
        if not stubs:
            raise ServerNotReady(f"no python stub of {model} under tritonserver pid {pid}")
        for stub in stubs if every_instance else stubs[:1]:
            os.kill(stub, signal.SIGKILL)
        return stubs[0]

    def restarts(self) -> list[tuple[float, str]]:
        """(time, reason) of each restart the watcher announced."""
        return [(t, ln.split("(", 1)[-1].rsplit(")", 1)[0]) for t, ln in self.lines if "watch: restarting" in ln]

    def ready_again(self) -> list[float]:
        return [t for t, ln in self.lines if "watch: ready again" in ln]

    def stop(self) -> dict:
        """SIGTERM the watcher (it stops its server); stop stubs of killed servers that outlived them and the
        shared-memory regions those servers left. Returns what had to be cleaned up."""
        out: dict[str, Any] = {"watcher_rc": None, "orphan_stubs_killed": 0, "shm_regions_removed": 0}
        if self.proc is None:
            return out
        pid = self.server_pid()
        self.proc.send_signal(signal.SIGTERM)
        try:
            out["watcher_rc"] = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out["watcher_rc"] = self.proc.wait(timeout=10)
            if pid:
                from bge_triton.server.launcher import stop_pid

                stop_pid(pid)
        for p, cmd in self.stubs_seen.items():  # stubs of a SIGKILLed server can outlive it (docs/reliability.md)
            try:
                proc = psutil.Process(p)
                if proc.status() == psutil.STATUS_ZOMBIE or " ".join(proc.cmdline()) != cmd:
                    continue  # exited, or the pid now names another process: never touch it
            except psutil.NoSuchProcess:
                continue
            os.kill(p, signal.SIGKILL)
            out["orphan_stubs_killed"] += 1
        time.sleep(0.5)
        ours = {cmd.split()[2].lstrip("/") for cmd in self.stubs_seen.values() if len(cmd.split()) > 2}
        for name in shm_regions() & ours:  # regions named on our stubs' command lines, left by a killed server
            (Path("/dev/shm") / name).unlink(missing_ok=True)
            out["shm_regions_removed"] += 1
        self.proc = None
        return out

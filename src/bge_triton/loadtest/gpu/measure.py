"""What the bench measures besides requests: the card's matmul rate, GPU utilisation, the machine."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import threading
import time

import torch


def matmul_tflops(device: str, dtype: torch.dtype, size: int, seconds: float = 2.0) -> float:
    """Measured dense matmul rate (TFLOP/s) of size x size x size products: the compute yardstick."""
    dev = torch.device(device)
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        torch.matmul(a, b)
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        reps = 20 if dev.type == "cuda" else 2
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        best = max(best, 2.0 * size ** 3 * reps / (time.perf_counter() - t0) / 1e12)
    return best


class GpuSampler:
    """Samples GPU utilisation (%) with `nvidia-smi -lms`; mean over any wall-clock window (index < 0: off)."""

    def __init__(self, device_index: int, period_ms: int = 100):
        self.samples: list[tuple[float, float]] = []
        self.proc: subprocess.Popen | None = None
        self.source = "n/a"
        exe = shutil.which("nvidia-smi")
        if device_index < 0 or exe is None:  # CPU run, or no driver tools: report n/a
            return
        self.proc = subprocess.Popen(
            [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
             f"--id={device_index}", f"-lms={period_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.source = "nvidia-smi"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip())))
            except ValueError:
                continue

    def mean(self, t_begin: float, t_end: float) -> float | None:
        vals = [v for t, v in list(self.samples) if t_begin <= t <= t_end]
        return sum(vals) / len(vals) if vals else None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def machine_info(device: str) -> dict[str, str]:
    """Where the numbers came from: GPU, driver, CPU count, Python, torch."""
    info = {
        "host": platform.node(), "cpus": str(os.cpu_count()), "python": platform.python_version(),
        "torch": torch.__version__, "platform": platform.platform(),
    }
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        info["gpu"] = torch.cuda.get_device_name(idx)
        info["cuda"] = str(torch.version.cuda)
        exe = shutil.which("nvidia-smi")
        if exe:
            out = subprocess.run([exe, "--query-gpu=driver_version,memory.total", "--format=csv,noheader",
                                  f"--id={idx}"], capture_output=True, text=True, timeout=30)
            info["driver, memory"] = out.stdout.strip()
    else:
        info["gpu"] = "none (CPU run: tiny model, ratios only, absolute numbers mean nothing)"
        info["cpu"] = platform.processor() or platform.machine()
    return info

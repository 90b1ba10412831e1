"""Helpers of the deploy tests: podman, its Docker-compatible API for docker-compose, and a compose project.

Everything a test starts is removed by id (containers, volumes, network through `down -v`; the API service by
its pid); images stay, so a second run reuses them (podman's layer cache and build.sh's image check).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.cpu.yml", "tests/deploy/compose.standin.yml")


def why_podman_cannot_run(tools: tuple[str, ...] = ("docker-compose",)) -> str | None:
    """None where rootful podman (and `tools`) can run here; else why not (the skip reason of both deploy tests).

    Both build the images from `git archive HEAD` (deploy/build-images.sh): git and a checkout are needed too.
    """
    missing = [tool for tool in ("podman", "debootstrap", "git", *tools) if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (.ci/run installs podman, buildah, catatonit, debootstrap and "
                "docker-compose with apt-get; kubectl (>= 1.27) renders the Kustomize base)")
    if not (REPO / ".git").exists():
        return "the images are built from `git archive HEAD`: needs a git checkout"
    if os.geteuid() != 0:
        return "the deploy tests need rootful podman (run as root)"
    proc = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        return f"`podman info` fails: {proc.stderr.strip()[-500:]}"
    return None


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 600,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise with its output (the tail of both streams)."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


class ApiService:
    """`podman system service` on a socket of its own (docker-compose's DOCKER_HOST), stopped by pid."""

    def __init__(self, name: str) -> None:
        self.socket = Path(f"/tmp/{name}.sock")
        self.log = Path(f"/tmp/{name}.service.log")
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"podman system service did not open {self.socket}: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    @property
    def docker_host(self) -> str:
        return f"unix://{self.socket}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.socket.unlink(missing_ok=True)


class HealthDriver(threading.Thread):
    """Runs the project's container healthchecks (`podman healthcheck run`) every `interval` seconds.

    podman runs healthchecks from systemd timers; these machines have no systemd, so without this a service
    with a healthcheck stays "starting" and compose's `condition: service_healthy` never holds. The checks
    themselves are the compose file's / image's own commands, run by podman as the timer would.
    """

    def __init__(self, project: str, interval: float = 2.0) -> None:
        super().__init__(daemon=True, name=f"health-{project}")
        self.project, self.interval = project, interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            ids = subprocess.run(["podman", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"],
                                 capture_output=True, text=True).stdout.split()
            for cid in ids:
                subprocess.run(["podman", "healthcheck", "run", cid], capture_output=True, text=True)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)


@dataclass
class Project:
    """One compose project in its own directory (a clean archive of the tree under test), its own name and ports."""

    directory: Path
    docker_host: str
    name: str = field(default_factory=lambda: f"bgedeploy{uuid.uuid4().hex[:8]}")
    ports: dict[str, int] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
        env.update(DOCKER_HOST=self.docker_host, BIND_ADDR="127.0.0.1", **self.extra_env,
                   **{key: str(port) for key, port in self.ports.items()})
        return env

    def gateway_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.ports['GATEWAY_PORT']}{path}"

    def triton_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.ports['TRITON_HTTP_PORT']}{path}"

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        files = [arg for f in COMPOSE_FILES for arg in ("-f", f)]
        return run(["docker-compose", "-p", self.name, *files, *args], env=self.env, cwd=self.directory,
                   timeout=timeout, check=check)

    def container(self, service: str, *, running_only: bool = False) -> str:
        """The id of the service's container (the newest when compose kept an older one)."""
        flags = [] if running_only else ["-a"]
        out = run(["podman", "ps", *flags, "-q", "--sort", "created",
                   "--filter", f"label=com.docker.compose.project={self.name}",
                   "--filter", f"label=com.docker.compose.service={service}"]).stdout.split()
        if not out:
            raise LookupError(f"no container of service {service} in project {self.name}")
        return out[-1]

    def logs(self, service: str) -> str:
        proc = run(["podman", "logs", self.container(service)])
        return proc.stdout + proc.stderr

    def exit_code(self, service: str) -> int:
        out = run(["podman", "inspect", "--format", "{{.State.ExitCode}}", self.container(service)]).stdout
        return int(out.strip())

    def read_file(self, service: str, path: str) -> str:
        return run(["podman", "exec", self.container(service, running_only=True), "cat", path]).stdout.strip()

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that podman still holds."""
        label = f"label=com.docker.compose.project={self.name}"
        containers = run(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", label]).stdout.split()
        networks = [n for n in run(["podman", "network", "ls", "--format", "{{.Name}}"]).stdout.split()
                    if n.startswith(f"{self.name}_")]
        volumes = [v for v in run(["podman", "volume", "ls", "--format", "{{.Name}}"]).stdout.split()
                   if v.startswith(f"{self.name}_")]
        return {"containers": containers, "networks": networks, "volumes": volumes}


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound together, so no two are the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_raw(method: str, url: str, body: object | None = None, headers: dict[str, str] | None = None,
             timeout: float = 60) -> tuple[int, bytes]:
    """(status, body bytes) of one HTTP request; error statuses are returned, not raised; status 0 and the error's
    text when nothing answered (not listening yet, reset)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, OSError) as err:
        return 0, str(err).encode()


def http(method: str, url: str, body: object | None = None, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON body or {}) of one HTTP request; error statuses are returned, not raised."""
    status, raw = http_raw(method, url, body, headers, timeout)
    if status == 0:
        raise urllib.error.URLError(raw.decode(errors="replace"))
    try:
        return status, json.loads(raw) if raw else {}
    except ValueError:
        return status, {"raw": raw.decode(errors="replace")}


def wait_until(check, what: str, timeout: float, interval: float = 1.0):
    """Poll `check()` until it returns a truthy value (returned) or `timeout` seconds pass (RuntimeError)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            result = check()
        except (OSError, urllib.error.URLError) as exc:  # not listening yet
            result, last = None, exc
        if result:
            return result
        time.sleep(interval)
    raise RuntimeError(f"{what}: not within {timeout:.0f} s (last error: {last})")

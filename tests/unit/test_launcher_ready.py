"""LocalServer.wait_ready: ready means HTTP's readiness and the gRPC and metrics listeners accepting, on ports
that THIS server's log says it bound (another process on the same ports would answer as well).

Triton 2.51 starts its listeners one after the other (the metrics one ~40 ms after HTTP on this machine):
a test that read /metrics right after an HTTP-only readiness once found nothing listening there.
Fakes on 127.0.0.1 stand in for the three listeners; no tritonserver.
"""
from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path

import pytest

from bge_triton.errors import PortInUse, ServerNotReady
from bge_triton.server.launcher import LocalServer, ServerSettings


class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_ready():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _listener(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _log(server: LocalServer, *lines: str) -> None:
    server.state.mkdir(parents=True, exist_ok=True)
    server.log_path.write_text("".join(f'I1203 07:00:00.000000 1 server.cc:1] "{line}"\n' for line in lines))


def _bound(server: LocalServer) -> tuple[str, ...]:
    s = server.settings
    return (f"Started GRPCInferenceService at 127.0.0.1:{s.grpc_port}", f"Started HTTPService at 127.0.0.1:"
            f"{s.http_port}", f"Started Metrics Service at 127.0.0.1:{s.metrics_port}")


def test_ready_waits_for_the_metrics_listener(tmp_path: Path, http_ready: int) -> None:
    grpc, metrics = _listener(_free_port()), None
    metrics_port = _free_port()
    server = LocalServer(ServerSettings(repository=tmp_path, http_port=http_ready, grpc_port=grpc.getsockname()[1],
                                        metrics_port=metrics_port, state_dir=tmp_path / "state"))
    _log(server, *_bound(server))
    opened = threading.Event()

    def open_metrics() -> None:
        nonlocal metrics
        metrics = _listener(metrics_port)
        opened.set()

    timer = threading.Timer(0.6, open_metrics)  # HTTP ready at once, metrics later: as Triton starts them
    timer.start()
    try:
        server.wait_ready(10)
        assert opened.is_set(), "wait_ready returned before the metrics port accepted connections"
    finally:
        timer.cancel()
        grpc.close()
        if metrics is not None:
            metrics.close()


def test_not_ready_without_the_grpc_listener(tmp_path: Path, http_ready: int) -> None:
    metrics = _listener(_free_port())
    server = LocalServer(ServerSettings(repository=tmp_path, http_port=http_ready, grpc_port=_free_port(),
                                        metrics_port=metrics.getsockname()[1], state_dir=tmp_path / "state"))
    _log(server, *_bound(server))
    try:
        with pytest.raises(ServerNotReady, match="not ready after"):
            server.wait_ready(1)
    finally:
        metrics.close()


def test_listeners_of_another_process_are_not_this_servers(tmp_path: Path, http_ready: int) -> None:
    """Every port answers, but this server's log does not say it bound them: not ready."""
    grpc, metrics = _listener(_free_port()), _listener(_free_port())
    server = LocalServer(ServerSettings(repository=tmp_path, http_port=http_ready, grpc_port=grpc.getsockname()[1],
                                        metrics_port=metrics.getsockname()[1], state_dir=tmp_path / "state"))
    _log(server, "Server is starting")
    try:
        with pytest.raises(ServerNotReady, match="not ready after"):
            server.wait_ready(1)
    finally:
        grpc.close()
        metrics.close()


def test_a_port_taken_after_the_pick_is_port_in_use(tmp_path: Path, http_ready: int) -> None:
    server = LocalServer(ServerSettings(repository=tmp_path, http_port=http_ready, grpc_port=_free_port(),
                                        metrics_port=_free_port(), state_dir=tmp_path / "state"))
    s = server.settings
    _log(server, f"failed to start GRPC service: Unavailable - Socket '127.0.0.1:{s.grpc_port}' already in use ")
    with pytest.raises(PortInUse, match=f"grpc {s.grpc_port}"):
        server.wait_ready(30)

"""LocalServer.wait_ready: ready means HTTP's readiness and the gRPC and metrics listeners accepting.

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

from bge_triton.errors import ServerNotReady
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


def test_ready_waits_for_the_metrics_listener(tmp_path: Path, http_ready: int) -> None:
    grpc, metrics = _listener(_free_port()), None
    metrics_port = _free_port()
    server = LocalServer(ServerSettings(repository=tmp_path, http_port=http_ready, grpc_port=grpc.getsockname()[1],
                                        metrics_port=metrics_port, state_dir=tmp_path / "state"))
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
    try:
        with pytest.raises(ServerNotReady, match="not ready after"):
            server.wait_ready(1)
    finally:
        metrics.close()

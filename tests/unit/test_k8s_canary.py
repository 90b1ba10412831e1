"""deploy/k8s/base/canary.sh (the Triton pod's readiness/liveness command) against a scripted HTTP server:
what it sends, and which answers keep a pod in rotation (a unit vector; 503 = overloaded) and which fail it."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tests.deploy.ci import must_run

CANARY = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "canary.sh"
REASON = "canary.sh needs sh and curl (both in the server image): apt-get install curl"
MISSING = shutil.which("curl") is None or shutil.which("sh") is None
must_run(REASON if MISSING else None, "the Kubernetes canary tests")
pytestmark = pytest.mark.skipif(MISSING, reason=REASON)
DIM = 8
UNIT = [1 / math.sqrt(DIM)] * DIM


class Scripted(BaseHTTPRequestHandler):
    """Answers every POST with the server's (status, body, delay); records the requests."""

    def do_POST(self) -> None:  # http.server's name
        length = int(self.headers["Content-Length"])
        self.server.seen.append((self.path, json.loads(self.rfile.read(length))))
        status, body, hung = self.server.answer
        if hung:  # never answers while the test runs (released at teardown)
            self.server.release.wait(60)
            return
        payload = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    srv.daemon_threads = True  # a handler still sleeping for the hung-server case does not block the teardown
    srv.seen, srv.answer, srv.release = [], (200, {}, False), threading.Event()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


TIMEOUT_S = 30  # curl's --max-time for the answering cases: a bound on a hang, never reached by a busy machine


def run(srv, status: int, body, hung: bool = False, **env: str) -> subprocess.CompletedProcess:
    srv.answer = (status, body, hung)
    full = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "CANARY_URL": f"http://127.0.0.1:{srv.server_address[1]}", "CANARY_MODEL": "m", "CANARY_INPUT": "text",
            "CANARY_DIM": str(DIM), "CANARY_REPEAT": "2", "CANARY_TIMEOUT_S": str(TIMEOUT_S), **env}
    return subprocess.run(["sh", str(CANARY)], env=full, capture_output=True, text=True, timeout=3 * TIMEOUT_S)


def embedding(data: list) -> dict:
    return {"model_name": "m", "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [1, len(data)],
                                            "data": data}]}


def test_a_unit_vector_passes_and_the_request_is_one_bytes_text(server) -> None:
    proc = run(server, 200, embedding(UNIT))
    assert proc.returncode == 0, proc.stderr
    assert len(server.seen) == 2  # CANARY_REPEAT requests
    path, body = server.seen[0]
    assert path == "/v2/models/m/infer"
    (inp,) = body["inputs"]
    assert (inp["name"], inp["datatype"], inp["shape"], len(inp["data"])) == ("text", "BYTES", [1, 1], 1)
    assert 0 < body["parameters"]["timeout"] < TIMEOUT_S * 1_000_000  # the queue gives up before curl does


@pytest.mark.parametrize("status,body,why", [
    (500, {"error": "Stub process 'bge_large_zh_0_0' is not healthy."}, "is not healthy"),
    (400, {"error": "unexpected inference input 'txt'"}, "HTTP 400"),
    (404, {"error": "Request for unknown model"}, "HTTP 404"),
    (200, embedding([x * 2 for x in UNIT]), "norm 2.0000"),
    (200, embedding(UNIT[:-1]), f"expected {DIM} finite floats, got {DIM - 1}"),
    (200, '{"outputs":[{"data":[NaN,0,0,0,0,0,0,1]}]}', "finite floats"),
])
def test_a_broken_model_fails_the_probe(server, status: int, body, why: str) -> None:
    proc = run(server, status, body)
    assert proc.returncode != 0 and why in proc.stderr, (proc.returncode, proc.stderr)
    assert len(server.seen) == 1  # the first failure ends the probe


@pytest.mark.parametrize("status", [503, 429])
def test_an_overloaded_server_is_alive(server, status: int) -> None:
    proc = run(server, status, {"error": "Exceeds maximum queue size"})
    assert proc.returncode == 0 and "overloaded" in proc.stdout, proc.stderr


def test_a_hung_server_fails_within_the_timeout(server) -> None:
    proc = run(server, 200, embedding(UNIT), hung=True, CANARY_TIMEOUT_S="1")  # held until the test ends
    assert proc.returncode != 0 and "curl exit 28" in proc.stderr  # curl's --max-time, not the server's answer


def test_no_server_fails(server) -> None:
    proc = run(server, 200, {}, CANARY_URL="http://127.0.0.1:9")
    assert proc.returncode != 0 and "curl exit" in proc.stderr

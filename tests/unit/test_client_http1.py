"""client.http1 (urllib3's pool) and the sync HTTP transport against scripted HTTP servers on 127.0.0.1 (no
tritonserver): keep-alive, chunked bodies, a reconnect after an idle close, deadlines, a cut response, errors."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from bge_triton.client.core import text_call
from bge_triton.client.errors import InputError, ServerUnavailable, classify
from bge_triton.client.http1 import HttpPool
from bge_triton.client.transport import HttpSync
from bge_triton.errors import Timeout

Handler = Callable[[socket.socket, int], None]


class Scripted:
    """Accepts connections on 127.0.0.1 and runs handler(conn, n) on each (n: the connection's number)."""

    def __init__(self, handler: Handler) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handler = handler
        self.accepted = 0
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self.handler, args=(conn, self.accepted), daemon=True).start()

    def read_request(self, conn: socket.socket) -> bytes | None:
        """One whole request's body (head + body recorded); None when the client closed the connection."""
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        self.requests.append(head + b"\r\n\r\n" + body)
        return body

    def close(self) -> None:
        self.sock.close()


def reply(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.fixture
def scripted():
    servers = []

    def make(handler: Handler) -> Scripted:
        servers.append(Scripted(handler))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_keep_alive_reuses_one_connection(scripted) -> None:
    def handler(conn, n):
        while srv.read_request(conn) is not None:
            conn.sendall(reply(f"pong {n} {len(srv.requests)}".encode()))

    srv = scripted(handler)
    c = HttpPool("127.0.0.1", srv.port)
    bodies = [c.request("POST", "/x", b"ping", timeout_s=5).body for _ in range(3)]
    assert bodies == [b"pong 1 1", b"pong 1 2", b"pong 1 3"] and srv.accepted == 1
    assert srv.requests[0].startswith(b"POST /x HTTP/1.1\r\n") and srv.requests[0].endswith(b"\r\n\r\nping")


def test_chunked_body_and_trailers(scripted) -> None:
    def handler(conn, n):
        srv.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: 1\r\n\r\n")

    srv = scripted(handler)
    r = HttpPool("127.0.0.1", srv.port).request("GET", "/", timeout_s=5)
    assert r.status == 200 and r.body == b"hello, world"


def test_idle_close_reconnects_silently(scripted) -> None:
    closed = threading.Event()

    def handler(conn, n):  # answers one request per connection, then closes it (like a restart)
        srv.read_request(conn)
        conn.sendall(reply(f"conn {n}".encode()))
        conn.close()
        closed.set()

    srv = scripted(handler)
    c = HttpPool("127.0.0.1", srv.port)
    assert c.request("GET", "/", timeout_s=5).body == b"conn 1"
    assert closed.wait(30)  # the server has closed the idle connection
    assert c.request("GET", "/", timeout_s=5).body == b"conn 2"  # stale socket: reconnected, not failed
    assert srv.accepted == 2


def test_connection_close_header_is_honoured(scripted) -> None:
    def handler(conn, n):
        while srv.read_request(conn) is not None:
            conn.sendall(reply(b"bye", extra="Connection: close\r\n"))

    srv = scripted(handler)
    c = HttpPool("127.0.0.1", srv.port)
    c.request("GET", "/", timeout_s=5)
    c.request("GET", "/", timeout_s=5)
    assert srv.accepted == 2


def test_deadline_bounds_a_silent_server(scripted) -> None:
    release = threading.Event()

    def handler(conn, n):
        while srv.read_request(conn) is not None:
            if n == 1:
                release.wait(30)  # the first connection never answers in time
            conn.sendall(reply(f"conn {n}".encode()))

    srv = scripted(handler)
    c = HttpPool("127.0.0.1", srv.port)
    try:
        with pytest.raises(Timeout) as info:
            c.request("GET", "/", timeout_s=0.3)
    finally:
        release.set()
    assert "timeout_s=0.3" in str(info.value) and classify(info.value) is info.value
    assert c.request("GET", "/", timeout_s=5).body == b"conn 2"  # a timed-out connection is never reused


def test_cut_response_is_a_connection_failure(scripted) -> None:
    def handler(conn, n):
        srv.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        conn.close()

    srv = scripted(handler)
    with pytest.raises(ServerUnavailable) as info:
        HttpPool("127.0.0.1", srv.port).request("GET", "/", timeout_s=5)
    assert not isinstance(info.value, Timeout) and "connection failed" in str(info.value)


def test_refused_connection_is_server_unavailable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerUnavailable) as info:
        HttpPool("127.0.0.1", port).request("GET", "/", timeout_s=2)
    assert isinstance(classify(info.value), ServerUnavailable)


def test_http_sync_infer_decodes_binary_output_and_maps_errors(scripted) -> None:
    vec = np.arange(8, dtype=np.float32).reshape(2, 4)

    def handler(conn, n):
        while True:
            body = srv.read_request(conn)
            if body is None:
                return
            length = srv.requests[-1].split(b"Inference-Header-Content-Length: ")[1].split(b"\r\n")[0]
            header = json.loads(body[:int(length)])
            if header.get("parameters", {}).get("truncate") is False:
                conn.sendall(reply(json.dumps({"error": "text 0 has 600 tokens, over the limit of 512"}).encode(),
                                   status="400 Bad Request"))
                continue
            out = json.dumps({"model_name": "m", "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [2, 4],
                                                              "parameters": {"binary_data_size": 32}}]}).encode()
            conn.sendall(reply(out + vec.tobytes(), extra=f"Inference-Header-Content-Length: {len(out)}\r\n"))

    srv = scripted(handler)
    t = HttpSync(f"127.0.0.1:{srv.port}")
    result = t.infer(text_call("m", ["甲", "乙"], truncate=True), 5.0)
    np.testing.assert_array_equal(result.as_numpy("embedding"), vec)
    assert srv.requests[-1].startswith(b"POST /v2/models/m/infer HTTP/1.1\r\n")
    with pytest.raises(Exception) as info:
        t.infer(text_call("m", ["长"], truncate=False), 5.0)
    err = classify(info.value)
    assert isinstance(err, InputError) and "600 tokens" in str(err)
    assert srv.accepted == 1  # the error answer kept the connection
    t.close()


def test_http_sync_rejects_a_url_without_port() -> None:
    with pytest.raises(InputError, match="host:port"):
        HttpSync("localhost")


def _response(outputs: list[tuple[str, str, np.ndarray, bool]]) -> tuple[bytes, int]:
    """A Triton HTTP infer response body: (name, datatype, array, binary?) per output."""
    from tritonclient.utils import serialize_byte_tensor

    meta, blobs = [], []
    for name, dtype, arr, binary in outputs:
        entry = {"name": name, "datatype": dtype, "shape": list(arr.shape)}
        if binary:
            blob = (serialize_byte_tensor(arr).item() if dtype == "BYTES"
                    else arr.astype(arr.dtype.newbyteorder("<")).tobytes())
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        meta.append(entry)
    header = json.dumps({"model_name": "m", "outputs": meta}).encode()
    return header + b"".join(blobs), len(header)


@pytest.mark.parametrize("encoding", [None, "gzip", "deflate"])
def test_http_infer_result_reads_what_tritonclient_reads(encoding) -> None:
    import gzip
    import zlib

    import tritonclient.http as httpclient

    from bge_triton.client.transport import HttpInferResult

    outputs = [("names", "BYTES", np.array([b"a", b"bc"], dtype=object), True),
               ("ids", "INT64", np.array([[1, 2, 3]], dtype=np.int64), False),
               ("embedding", "FP32", np.arange(6, dtype=np.float32).reshape(2, 3), True)]
    body, header_length = _response(outputs)
    wire = {None: body, "gzip": gzip.compress(body), "deflate": zlib.compress(body)}[encoding]
    headers = {"inference-header-content-length": str(header_length)}
    if encoding:
        headers["content-encoding"] = encoding
    ours = HttpInferResult(wire, headers)
    theirs = httpclient.InferResult.from_response_body(wire, header_length=header_length, content_encoding=encoding)
    for name in ("names", "ids", "embedding", "missing"):
        a, b = ours.as_numpy(name), theirs.as_numpy(name)
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()

"""A lean HTTP/1.1 keep-alive connection for the sync HTTP transport (client.transport.HttpSync).

A text at quiet hours is one small request in flight, and its client time goes mostly to the HTTP
library, not to the wire. This connection does only what Triton's HTTP endpoint needs:
Content-Length and chunked bodies; keep-alive with one silent reconnect when a reused connection
turns out to be closed (the server restarted or dropped it while idle); one deadline per request that
bounds the connect, the send and every read. `python -m bge_triton.client.bench` reports the client overhead
per transport; `python -m bge_triton.loadtest.stack_bench` times the SDK over this connection beside
tritonclient's gRPC client.
"""
from __future__ import annotations

import socket
import threading
import time

__all__ = ["Http1Connection", "HttpResponse"]

MAX_HEADER_BYTES = 64 * 1024


class HttpResponse:
    """Status, headers (lower-case names) and the whole body of one response."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class _StaleConnection(Exception):
    """A reused connection was closed before any byte of the response came back."""


class Http1Connection:
    """One keep-alive connection to host:port; thread-safe (requests take turns on the socket)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._sock: socket.socket | None = None
        self._buf = b""
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                timeout_s: float = 10.0) -> HttpResponse:
        """Send one request and read its whole response within timeout_s seconds.

        Raises TimeoutError when the deadline passes, OSError (ConnectionError) when the server cannot
        be reached or closes the connection mid-response; the connection is then dropped, and the next
        request opens a new one.
        """
        deadline = time.monotonic() + timeout_s
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        with self._lock:
            reused = self._sock is not None
            try:
                try:
                    return self._exchange(data, deadline, reused)
                except _StaleConnection:  # closed while idle: the request never reached the server
                    self.close()
                    return self._exchange(data, deadline, False)
            except BaseException:
                self.close()  # unknown state (timeout, half-read response): never reuse it
                raise

    def close(self) -> None:
        """Drop the connection (the next request reconnects)."""
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._buf = b""

    # -- internals ---------------------------------------------------------------------------
    def _exchange(self, data: bytes, deadline: float, reused: bool) -> HttpResponse:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self._left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        self._sock.settimeout(self._left(deadline))
        try:
            self._sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            if reused:
                raise _StaleConnection() from exc
            raise
        try:
            header_block = self._read_until(b"\r\n\r\n", deadline)
        except (ConnectionResetError, EOFError) as exc:
            if reused and not self._buf:
                raise _StaleConnection() from exc
            raise
        status, headers, version = _parse_head(header_block)
        if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._read_chunked(deadline)
        elif "content-length" in headers:
            body = self._read_exact(int(headers["content-length"]), deadline)
        else:  # no length: the body runs to the end of the connection
            body = self._read_to_eof(deadline)
            headers["connection"] = "close"
        if headers.get("connection", "").lower() == "close":
            self.close()
        return HttpResponse(status, headers, body)

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("HTTP request deadline passed")
        return left

    def _recv(self, deadline: float) -> bytes:
        assert self._sock is not None
        self._sock.settimeout(self._left(deadline))
        chunk = self._sock.recv(262144)
        if not chunk:
            raise EOFError("the server closed the connection")
        return chunk

    def _read_until(self, marker: bytes, deadline: float) -> bytes:
        while True:
            at = self._buf.find(marker)
            if at >= 0:
                out, self._buf = self._buf[:at], self._buf[at + len(marker):]
                return out
            if len(self._buf) > MAX_HEADER_BYTES:
                raise ConnectionError(f"response header over {MAX_HEADER_BYTES} bytes: not an HTTP server?")
            self._buf += self._recv(deadline)

    def _read_exact(self, n: int, deadline: float) -> bytes:
        if len(self._buf) >= n:
            out, self._buf = self._buf[:n], self._buf[n:]
            return out
        parts, have = [self._buf], len(self._buf)
        self._buf = b""
        while have < n:
            chunk = self._recv(deadline)
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        self._buf = data[n:]
        return data[:n]

    def _read_chunked(self, deadline: float) -> bytes:
        parts = []
        while True:
            size_line = self._read_until(b"\r\n", deadline)
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ConnectionError(f"bad chunk size line {size_line[:40]!r} in the response") from None
            if size == 0:
                while self._read_until(b"\r\n", deadline):  # trailers, up to the empty line
                    pass
                return b"".join(parts)
            parts.append(self._read_exact(size, deadline))
            self._read_exact(2, deadline)  # the chunk's CRLF

    def _read_to_eof(self, deadline: float) -> bytes:
        parts = [self._buf]
        self._buf = b""
        while True:
            try:
                parts.append(self._recv(deadline))
            except EOFError:
                return b"".join(parts)


def _parse_head(block: bytes) -> tuple[int, dict[str, str], str]:
    lines = block.decode("latin-1").split("\r\n")
    try:
        version, code = lines[0].split(" ", 2)[:2]
        status = int(code)
    except ValueError:
        raise ConnectionError(f"bad HTTP status line {lines[0][:60]!r}: is this Triton's HTTP port?") from None
    if not version.startswith("HTTP/1."):
        raise ConnectionError(f"bad HTTP status line {lines[0][:60]!r}: is this Triton's HTTP port?")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers, version

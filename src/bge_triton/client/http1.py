"""HTTP/1.1 keep-alive connections for the sync HTTP transport (client.transport.HttpSync), on urllib3.

urllib3 (which tritonclient itself requires) does the protocol: framing, chunked bodies, keep-alive, a
pooled connection that the server closed while idle is dropped before reuse. This module adds only what
the SDK needs on top: one deadline per request (connect + read, urllib3.Timeout(total=...)), no retries of
its own (client.retry owns the policy), and the kit's error types: bge_triton.errors.Timeout when the
deadline passes, ServerUnavailable when the server cannot be reached or cuts the response.
Its one-in-flight cost against the hand-written client it replaced: docs/benchmarks.md.
"""
from __future__ import annotations

from collections.abc import Mapping

import urllib3
from urllib3.exceptions import HTTPError, NewConnectionError, ProtocolError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from bge_triton.errors import ServerUnavailable, Timeout

__all__ = ["HttpPool", "HttpResponse"]


class HttpResponse:
    """Status, headers (case-insensitive names) and the whole body of one response."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class HttpPool:
    """Keep-alive connections to host:port; thread-safe (each call in flight holds its own connection)."""

    def __init__(self, host: str, port: int, maxsize: int = 8) -> None:
        self.host, self.port = host, port
        self.maxsize = maxsize
        self._pool = self._new_pool()

    def _new_pool(self) -> urllib3.HTTPConnectionPool:
        # block=False: more calls in flight than maxsize open extra connections, closed after use
        return urllib3.HTTPConnectionPool(self.host, self.port, maxsize=self.maxsize, block=False, retries=False)

    def request(self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
                timeout_s: float = 10.0) -> HttpResponse:
        """Send one request and read its whole response within timeout_s seconds.

        Raises Timeout when the deadline passes, ServerUnavailable when the server cannot be reached or
        closes the connection mid-response (a connection in an unknown state is never reused).
        """
        where = f"{method} http://{self.host}:{self.port}{path}"
        try:
            response = self._pool.urlopen(method, path, body=body or None, headers=dict(headers or {}),
                                          timeout=urllib3.Timeout(total=timeout_s), retries=False,
                                          preload_content=True, decode_content=False, redirect=False)
        except NewConnectionError as exc:  # urllib3 derives it from its ConnectTimeoutError: refused, no route
            raise ServerUnavailable(f"{where}: cannot connect ({exc}); is tritonserver running at the url? "
                                    "(`bge-triton serve up ...`)") from exc
        except Urllib3Timeout as exc:
            raise Timeout(f"{where}: no answer within timeout_s={timeout_s}; raise timeout_s, or lower the load "
                          "(the server may still be working on it, so it is not retried)") from exc
        except (ProtocolError, HTTPError, OSError) as exc:
            raise ServerUnavailable(f"{where}: connection failed ({type(exc).__name__}: {exc}); is tritonserver "
                                    "running at the url? (`bge-triton serve up ...`)") from exc
        return HttpResponse(response.status, response.headers, response.data)

    def close(self) -> None:
        """Close every pooled connection (the next request opens a new one)."""
        pool, self._pool = self._pool, self._new_pool()
        pool.close()

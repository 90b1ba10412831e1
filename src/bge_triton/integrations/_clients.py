"""The SDK clients behind both adapters: one sync client, and one async client per event loop
(a gRPC aio channel belongs to the loop that opened it; frameworks call from several loops)."""
from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

from bge_triton.client import AsyncEmbeddingClient, EmbeddingClient

__all__ = ["SdkClients"]


class SdkClients:
    """Lazily connected EmbeddingClient / AsyncEmbeddingClient with the same arguments."""

    def __init__(self, url: str | None, model: str, **kwargs: Any) -> None:
        self.url, self.model, self.kwargs = url, model, kwargs
        self._sync: EmbeddingClient | None = None
        self._async: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> client
        self._lock = threading.Lock()

    def sync(self) -> EmbeddingClient:
        """The connected sync client (reads and checks the model's config on first use)."""
        with self._lock:
            if self._sync is None:
                self._sync = EmbeddingClient(self.url, model=self.model, **self.kwargs).connect()
            return self._sync

    async def aio(self) -> AsyncEmbeddingClient:
        """The connected async client of the running event loop."""
        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._async[loop] = AsyncEmbeddingClient(self.url, model=self.model, **self.kwargs)
        return await client.connect()

    def unchecked(self) -> EmbeddingClient:
        """The sync client without the embedder's config check (rerank() needs only the transport)."""
        with self._lock:
            if self._sync is None:
                self._sync = EmbeddingClient(self.url, model=self.model, **self.kwargs)
            return self._sync

    def aio_unchecked(self) -> AsyncEmbeddingClient:
        """The running loop's async client without the embedder's config check (for rerank())."""
        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._async[loop] = AsyncEmbeddingClient(self.url, model=self.model, **self.kwargs)
        return client

    def close(self) -> None:
        """Close the sync client (async clients close with their loop's aclose())."""
        with self._lock:
            if self._sync is not None:
                self._sync.close()
                self._sync = None

    async def aclose(self) -> None:
        """Close the running loop's async client."""
        client = self._async.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

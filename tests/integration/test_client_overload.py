"""Overload against a REAL tritonserver: a second server from the same repository, rendered with a
tiny queue (max_queue_size=1, max_batch_size=1) and a slow emulated encoder (cost model). Without
retries some callers get Overloaded ("Exceeds maximum queue size"); with retries all succeed."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bge_triton.client import AsyncEmbeddingClient, EmbeddingClient, Overloaded, RetryPolicy
from bge_triton.errors import ServerNotReady
from bge_triton.server.launcher import LocalServer, ServerSettings
from bge_triton.server.launcher import free_ports as launcher_free_ports

pytestmark = pytest.mark.integration

NAME = "minilm"
CALLERS = 6


def free_ports(n: int) -> list[int]:
    try:
        return launcher_free_ports(n, range(18000, 18100))
    except ServerNotReady:
        pytest.skip("not enough free ports in 18000-18099")

@pytest.fixture(scope="module")
def tiny_queue_server(minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from bge_triton.repository import Batching
    from bge_triton.server.cpu_variant import CpuVariant

    http, grpc, metrics = free_ports(3)
    variant = CpuVariant(executor="costmodel", cost_a_us=300_000, cost_b_us=0.0,
                         batching={NAME: Batching(max_queue_size=1, max_batch_size=1, max_queue_delay_us=0),
                                   f"{NAME}_onnx": Batching(max_queue_size=1, max_queue_delay_us=0)})
    settings = ServerSettings(repository=Path(minilm_repo), http_port=http,
                                       grpc_port=grpc, metrics_port=metrics, variant=variant,
                                       state_dir=tmp_path_factory.mktemp("tiny-queue-server"))
    with LocalServer(settings) as srv:
        yield srv.grpc_url


def _burst(url: str, policy: RetryPolicy) -> list[Any]:
    async def main() -> list[Any]:
        async with AsyncEmbeddingClient(url, model=NAME, retry=policy, timeout_s=20.0) as c:
            assert c.spec.max_batch_size == 1
            return await asyncio.gather(*(c.embed_documents([f"text {i}"]) for i in range(CALLERS)),
                                        return_exceptions=True)

    return asyncio.run(main())


def test_full_queue_raises_overloaded_without_retry(tiny_queue_server: str) -> None:
    results = _burst(tiny_queue_server, RetryPolicy.off())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors, "expected some requests to be rejected by a queue of size 1"
    assert all(isinstance(e, Overloaded) for e in errors), errors
    assert "Exceeds maximum queue size" in str(errors[0]) and "max_queue_size" in str(errors[0])


def test_full_queue_retried_then_success(tiny_queue_server: str) -> None:
    # budget off: this caller prefers completion over shedding (the default budget stops retrying
    # in a storm: tests/unit/test_client_retry.py::test_retry_budget_stops_amplifying_a_sustained_overload)
    policy = RetryPolicy(max_attempts=30, initial_backoff_s=0.1, max_backoff_s=1.0, total_s=60.0, budget_tokens=0)
    results = _burst(tiny_queue_server, policy)
    assert all(isinstance(r, np.ndarray) and r.shape == (1, 384) for r in results), results
    with EmbeddingClient(tiny_queue_server, model=NAME, retry=policy) as c:
        assert c.embed_documents(["one more"]).shape == (1, 384)

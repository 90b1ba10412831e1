"""The seed table's scenarios, the one table of them: `bench seed` (a server the kit starts) and `bench seed --url`
(a running Triton) both apply these batching fields to the encoder's committed or served config, nothing else."""
from __future__ import annotations

from bge_triton.repository import Batching

SCENARIOS: dict[str, Batching | None] = {  # None: the served configs as they are, called through the text endpoint
    "no_batching": Batching(enabled=False),
    "static_32": Batching(preferred_batch_sizes=(32,), max_queue_delay_us=10_000_000),  # full batches only
    "dynamic_5ms": Batching(preferred_batch_sizes=(16, 32), max_queue_delay_us=5000),
    "delay_0": Batching(preferred_batch_sizes=(), max_queue_delay_us=0),
    "text_endpoint": None,
}
# the seed table as published: one NVIDIA A10G, BGE-Large-zh, Python asyncio batcher (QPS, avg ms, P99 ms, util)
SEED = {
    "no_batching": (145, 6.8, 14.2, "18% GPU"),
    "static_32": (1200, 85.0, 240.0, "82% GPU"),
    "dynamic_5ms": (1180, 8.2, 16.5, "79% GPU"),
}

"""Load tests: Locust scenarios, the seed-table bench, the queue-delay tuner, chaos, reports."""

from bge_triton.extras import require

require("loadtest", "bge_triton.loadtest (Locust, benches, reports)")

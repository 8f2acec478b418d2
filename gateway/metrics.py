"""Prometheus metrics of a gateway: requests by route and status, latency, open streams,
batches by status (read from Redis at scrape time)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "pagedq_gateway_requests_total",
    "HTTP requests answered, by route and status code",
    ["method", "route", "status"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "pagedq_gateway_request_duration_seconds",
    "Seconds from a request's arrival to the end of its response (whole stream included)",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
OPEN_STREAMS = Gauge(
    "pagedq_gateway_open_streams", "Server-sent event streams open now", registry=REGISTRY
)
TTFT = Histogram(
    "pagedq_gateway_time_to_first_token_seconds",
    "Seconds from a streamed request's arrival to its first content chunk",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
BATCHES_ENDED = Counter(
    "pagedq_gateway_batches_ended_total",
    "Batches this gateway ended, by final status",
    ["status"],
    registry=REGISTRY,
)
CANCELED_ON_DISCONNECT = Counter(
    "pagedq_gateway_disconnect_cancels_total",
    "Jobs canceled because their client went away",
    registry=REGISTRY,
)


class ActiveBatches:
    """A collector of `pagedq_gateway_batches{status}`: the active batches in Redis by status."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self.read = read

    def collect(self):
        """Read the statuses now (one SMEMBERS and one HGET per active batch)."""
        family = GaugeMetricFamily(
            "pagedq_gateway_batches", "Active batches in Redis by status", labels=["status"]
        )
        try:
            counts = self.read()
        except Exception:  # Redis down: no sample rather than a failed scrape
            counts = {}
        for status, n in sorted(counts.items()):
            family.add_metric([status], n)
        yield family


class MetricsMiddleware:
    """Counts and times every HTTP request by its route template (not its raw path)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # The router put the matched route in the scope: label by its template, not the path.
            route = getattr(scope.get("route"), "path", "unmatched")
            REQUESTS.labels(scope["method"], route, str(status)).inc()
            LATENCY.labels(scope["method"], route).observe(time.perf_counter() - start)

"""Prometheus metrics of one worker, served on /metrics by prometheus_client."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets from a few ms (a GPU decode step) to minutes (a long CPU job).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class WorkerMetrics:
    """The worker's gauges, counters and histograms, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge(
            "pagedq_requests_running", "Requests in the batch", registry=r
        )
        self.requests_waiting = Gauge(
            "pagedq_requests_waiting", "Requests admitted but waiting for KV blocks", registry=r
        )
        self.jobs_in_flight = Gauge(
            "pagedq_jobs_in_flight", "Started jobs not yet ended", registry=r
        )
        self.kv_cache_usage = Gauge(
            "pagedq_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1)", registry=r
        )
        self.prefix_cache_hit_rate = Gauge(
            "pagedq_prefix_cache_hit_rate", "Prefix cache hit rate (0..1)", registry=r
        )
        self.preemptions = Counter("pagedq_preemptions", "Requests preempted", registry=r)
        self.generated_tokens = Counter("pagedq_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter(
            "pagedq_prompt_tokens", "Prompt tokens of ended jobs", registry=r
        )
        self.jobs = Counter("pagedq_jobs", "Jobs ended, by status", ["status"], registry=r)
        self.ttft = Histogram(
            "pagedq_time_to_first_token_seconds",
            "From admission to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "pagedq_inter_token_latency_seconds",
            "Time between two tokens of a job",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "pagedq_e2e_request_latency_seconds",
            "From enqueue to the end of the job",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._num_preemptions = 0

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics on a background thread."""
        start_http_server(port, addr=addr, registry=self.registry)

    def observe_stats(self, stats: Any, in_flight: int) -> None:
        """Copy an EngineStats snapshot into the gauges."""
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting)
        self.jobs_in_flight.set(in_flight)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        # EngineStats counts preemptions since start; a Counter only moves forward.
        if stats.num_preemptions > self._num_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._num_preemptions)
            self._num_preemptions = stats.num_preemptions

    def observe_tokens(self, num_new: int, seconds_since_last: float | None) -> None:
        """Count one step's new tokens of a job; spread the step's wait over them."""
        self.generated_tokens.inc(num_new)
        if seconds_since_last is not None and num_new > 0:
            per_token = seconds_since_last / num_new
            for _ in range(num_new):
                self.inter_token_latency.observe(per_token)

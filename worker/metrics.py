"""Prometheus metrics of one worker, named after vLLM's (`vllm:` becomes `pagedq:`).

Gauges and engine counters are read at scrape time from a fresh engine stats snapshot (a custom
collector over `stats_fn`), so they are never older than one engine step. Per-request
histograms and counters are observed by the control loop as jobs produce tokens and end.
Every series carries a `model_name` label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.endpoints import MetricsServer

# Latency buckets from a few ms (a GPU decode step) to many minutes (a long CPU job).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Token-count buckets: 1, 2, 5 per decade, as vLLM builds them (up to 2 million tokens).
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))[:-1]
FINISHED_REASONS = ("stop", "length", "abort")
JOB_STATUSES = ("finished", "failed", "canceled")
# EngineStats fields read when present (engine-sched adds them; 0 / {} before that lands).
PREEMPTION_FIELDS = {"recompute": "num_preemptions_recompute", "swap": "num_preemptions_swap"}
# Structured outputs: (metric, help, EngineStats field).
STRUCTURED_OUTPUT_COUNTERS = (
    ("pagedq:grammar_compiles", "Structured-output grammars compiled.", "num_grammar_compiles"),
    (
        "pagedq:grammar_compile_seconds",
        "Seconds spent compiling grammars (on the compile threads).",
        "grammar_compile_seconds",
    ),
    (
        "pagedq:grammar_cache_hits",
        "Constrained requests whose grammar was already compiled.",
        "grammar_cache_hits",
    ),
    (
        "pagedq:grammar_failures",
        "Requests failed by their grammar (invalid, too slow to compile, or refusing a token).",
        "num_grammar_failures",
    ),
    (
        "pagedq:constrained_tokens",
        "Tokens sampled under a grammar's mask.",
        "num_constrained_tokens",
    ),
    (
        "pagedq:forced_tokens",
        "Tokens a grammar appended alone, without a decode step.",
        "num_forced_tokens",
    ),
)


class EngineStatsCollector(Collector):
    """Gauges and engine counters built from one `stats_fn()` snapshot per scrape.

    While `stats_fn()` returns None (the model is still loading) only `jobs_in_flight` is shown.
    """

    def __init__(
        self,
        model_name: str,
        stats_fn: Callable[[], Any],
        in_flight_fn: Callable[[], int],
    ) -> None:
        self.model_name = model_name
        self.stats_fn = stats_fn
        self.in_flight_fn = in_flight_fn

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def collect(self) -> Iterator[Metric]:
        """One consistent snapshot of the engine, read now."""
        s = self.stats_fn()
        yield self._gauge(
            "pagedq:jobs_in_flight",
            "RQ jobs this worker has started and not yet ended.",
            self.in_flight_fn(),
        )
        if s is None:
            return
        yield self._gauge(
            "pagedq:num_requests_running", "Requests in the running batch.", s.num_running
        )
        yield self._gauge(
            "pagedq:num_requests_waiting",
            "Requests in the engine waiting for KV blocks or a batch slot (preempted included).",
            s.num_waiting,
        )
        yield self._gauge(
            "pagedq:num_requests_swapped",
            "Requests whose KV blocks are swapped out to the CPU pool.",
            getattr(s, "num_swapped", 0),
        )
        yield self._gauge(
            "pagedq:kv_cache_usage_perc",
            "KV-cache usage: fraction of blocks held by requests, 1 means 100 percent.",
            s.kv_cache_usage,
        )
        yield self._counter(
            "pagedq:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            getattr(s, "prefix_cache_queries", 0),
        )
        yield self._counter(
            "pagedq:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            getattr(s, "prefix_cache_hits", 0),
        )
        yield self._counter(
            "pagedq:prompt_tokens",
            "Prompt tokens computed by prefill (prefix-cache hits not included).",
            s.num_prompt_tokens,
        )
        yield self._counter("pagedq:generation_tokens", "Tokens generated.", s.num_generated_tokens)
        yield self._counter("pagedq:engine_steps", "Engine iterations run.", s.num_steps)
        yield from self._preemptions(s)
        yield self._kv_groups(s)
        yield from self._structured_outputs(s)
        yield self._counter(
            "pagedq:swapped_out_bytes",
            "Bytes of KV cache copied out to the CPU swap pool.",
            getattr(s, "swapped_out_bytes", 0),
        )
        tenants = CounterMetricFamily(
            "pagedq:tenant_generation_tokens",
            "Tokens generated per tenant.",
            labels=["model_name", "tenant"],
        )
        for tenant, n in sorted((getattr(s, "tenant_generated_tokens", None) or {}).items()):
            tenants.add_metric([self.model_name, str(tenant)], n)
        yield tenants

    def _structured_outputs(self, s: Any) -> Iterator[Metric]:
        for name, doc, field in STRUCTURED_OUTPUT_COUNTERS:
            yield self._counter(name, doc, getattr(s, field, 0))

    def _kv_groups(self, s: Any) -> GaugeMetricFamily:
        g = GaugeMetricFamily(
            "pagedq:kv_cache_group_blocks",
            "KV blocks held per layer group (group: its index; kind: full_attention, "
            "sliding_window=W; recurrent_state: state slots held, hybrid linear attention).",
            labels=["model_name", "group", "kind"],
        )
        for i, (kind, n) in enumerate(getattr(s, "kv_blocks_by_group", None) or []):
            g.add_metric([self.model_name, str(i), kind], n)
        return g

    def _preemptions(self, s: Any) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "pagedq:num_preemptions",
            "Requests preempted, by kind (recompute: blocks freed; swap: blocks copied to CPU).",
            labels=["model_name", "kind"],
        )
        by_kind = {kind: getattr(s, field, None) for kind, field in PREEMPTION_FIELDS.items()}
        if by_kind["recompute"] is None:
            # Before swap preemption exists every preemption is a recompute.
            by_kind["recompute"] = s.num_preemptions - (by_kind["swap"] or 0)
        for kind, n in by_kind.items():
            c.add_metric([self.model_name, kind], n or 0)
        yield c


class WorkerMetrics:
    """A worker's metrics in a registry of their own: engine state plus per-request figures.

    `stats_fn` returns an `EngineStats`-like snapshot (the engine loop's latest, refreshed every
    step) or None before the engine exists; `in_flight_fn` the number of started RQ jobs;
    `health_fn` the /healthz body. Both callables can be given later with `attach()`, so that
    the port is bound (and a busy port reported) before the model loads.
    """

    def __init__(
        self,
        model_name: str = "",
        stats_fn: Callable[[], Any] | None = None,
        in_flight_fn: Callable[[], int] | None = None,
        health_fn: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        # vLLM's exposition has no `_created` series; this is process-wide in prometheus_client.
        disable_created_metrics()
        self.model_name = model_name
        self.health_fn = health_fn
        self._stats_fn = stats_fn
        self._in_flight_fn = in_flight_fn
        self.registry = r = CollectorRegistry()
        r.register(EngineStatsCollector(model_name, self._stats, self._in_flight))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.request_success = Counter(
            "pagedq:request_success",
            "Requests that ended, by finished_reason (stop, length; abort for a canceled job).",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.jobs_ended = Counter(
            "pagedq:jobs_ended",
            "RQ jobs ended by this worker, by status (finished, failed, canceled).",
            [*labels, "status"],
            registry=r,
        )
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for status in JOB_STATUSES:
            self.jobs_ended.labels(model_name, status)
        self.request_prompt_tokens = histogram(
            "pagedq:request_prompt_tokens", "Prompt tokens per ended request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "pagedq:request_generation_tokens",
            "Generated tokens per ended request (all samples).",
            TOKEN_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "pagedq:iteration_tokens_total",
            "Tokens computed per engine step (prefill chunks plus decodes).",
            TOKEN_BUCKETS,
        )
        self.request_queue_time = histogram(
            "pagedq:request_queue_time_seconds",
            "From enqueue in Redis until the engine first schedules the request.",
            LATENCY_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "pagedq:time_to_first_token_seconds",
            "From enqueue in Redis to the first generated token.",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "pagedq:inter_token_latency_seconds",
            "Time between two tokens of one request.",
            LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "pagedq:e2e_request_latency_seconds",
            "From enqueue in Redis to the end of the job.",
            LATENCY_BUCKETS,
        )

    def attach(self, stats_fn: Callable[[], Any], in_flight_fn: Callable[[], int]) -> None:
        """Give the engine stats and in-flight callables once the engine loop exists."""
        self._stats_fn, self._in_flight_fn = stats_fn, in_flight_fn

    def _stats(self) -> Any:
        return None if self._stats_fn is None else self._stats_fn()

    def _in_flight(self) -> int:
        return 0 if self._in_flight_fn is None else self._in_flight_fn()

    # --- called by the control loop ----------------------------------------------------------

    def observe_step(self, num_tokens: int) -> None:
        """Once per engine step that computed anything: the step's scheduled tokens."""
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    def observe_first_token(self, ttft_s: float) -> None:
        """Once per job, when its first token appears: seconds since the job was enqueued."""
        self.time_to_first_token.observe(max(0.0, ttft_s))

    def observe_new_tokens(self, num_new: int, since_last_token_s: float | None) -> None:
        """A job's new tokens of one step; `since_last_token_s` is None on its first token.

        A step that brings several tokens of one job spreads the wait evenly over them.
        """
        if since_last_token_s is None or num_new <= 0:
            return
        per_token = max(0.0, since_last_token_s) / num_new
        for _ in range(num_new):
            self.inter_token_latency.observe(per_token)

    def observe_job_end(
        self,
        status: str,
        finished_reason: str | None = None,
        prompt_tokens: int | None = None,
        generation_tokens: int | None = None,
        queued_s: float | None = None,
        e2e_s: float | None = None,
    ) -> None:
        """Once per ended job (finished, failed or canceled; not for a requeue).

        `request_success_total` counts finished jobs by their finish_reason and canceled jobs as
        "abort" (as vLLM counts aborted requests); failed jobs only in `jobs_ended_total`. The
        histograms take whatever figures the job has (a job that never ran has no tokens).
        """
        self.jobs_ended.labels(self.model_name, status).inc()
        if status == "canceled":
            finished_reason = "abort"
        if status in ("finished", "canceled") and finished_reason:
            self.request_success.labels(self.model_name, finished_reason).inc()
        if prompt_tokens is not None:
            self.request_prompt_tokens.observe(prompt_tokens)
        if generation_tokens is not None:
            self.request_generation_tokens.observe(generation_tokens)
        if queued_s is not None:
            self.request_queue_time.observe(max(0.0, queued_s))
        if e2e_s is not None:
            self.e2e_request_latency.observe(max(0.0, e2e_s))

    # --- serving -------------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve /metrics and /healthz on a background thread; MetricsPortInUse if taken."""
        return MetricsServer(self.registry, self.health_fn, host, port).start()

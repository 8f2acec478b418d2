"""TEMPORARY: the old WorkerMetrics calls, mapped onto the new metrics until the lead wires them.

The control loop of main still calls `WorkerMetrics()` without arguments, `observe_stats`,
`observe_tokens`, `ttft`, `jobs`, `prompt_tokens` and `e2e_latency`. Once batch_worker,
job_endings, leases and service call the new API (docs/OPERATIONS.md, "Wiring"), delete this
file and the `LegacyMetricsMixin` base of `WorkerMetrics`.
"""

from __future__ import annotations

from typing import Any


class _JobsByStatus:
    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def labels(self, status: str) -> Any:
        return self.metrics.jobs_ended.labels(self.metrics.model_name, status)


class _PromptTokens:
    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def inc(self, n: int) -> None:
        self.metrics.request_prompt_tokens.observe(n)


class LegacyMetricsMixin:
    """The pre-collector method names, kept only so that an unwired control loop still runs."""

    _legacy_stats: Any = None
    _legacy_in_flight: int = 0

    def observe_stats(self, stats: Any, in_flight: int) -> None:
        """Old: copy a stats snapshot in (shown only while no stats_fn is attached)."""
        self._legacy_stats, self._legacy_in_flight = stats, in_flight

    def observe_tokens(self, num_new: int, seconds_since_last: float | None) -> None:
        """Old name of `observe_new_tokens`."""
        self.observe_new_tokens(num_new, seconds_since_last)

    @property
    def ttft(self) -> Any:
        """Old name of the time-to-first-token histogram."""
        return self.time_to_first_token

    @property
    def e2e_latency(self) -> Any:
        """Old name of the end-to-end latency histogram."""
        return self.e2e_request_latency

    @property
    def jobs(self) -> _JobsByStatus:
        """Old `jobs.labels(status).inc()`."""
        return _JobsByStatus(self)

    @property
    def prompt_tokens(self) -> _PromptTokens:
        """Old `prompt_tokens.inc(n)`: now one observation of the prompt-tokens histogram."""
        return _PromptTokens(self)

"""The worker's status key (`producer.contract.keys.worker_key`), read by `pagedq status`,
`diagnose` and `top`, and its one writer.

`build_status` is a pure function of the engine's counters, so that producers can rely on the
fields without importing the worker; every field is documented in docs/SCHEDULING.md ("Worker
status"). `StatusPublisher` writes it from the control loop at most every `interval_s` (and at
once when the worker empties), so `pagedq status` is never older than about a second of engine
time; the key expires `ttl_s` after the last write, so a dead worker drops out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
import structlog

from producer.contract.keys import worker_key
from worker.endpoints import WorkerHealth

log = structlog.get_logger("pagedq.worker")

# Every 2 s, and at once when a count falls to 0: `pagedq status` and `pagedq top` show numbers at
# most 2 s old, and a thousand workers writing every 0.5 s would cost Redis 4x as much.
DEFAULT_INTERVAL_S = 2.0
# The key outlives a few missed writes, then vanishes with a dead worker.
DEFAULT_TTL_S = 10
# A failing write is logged at most this often.
ERROR_LOG_INTERVAL_S = 30.0

STATUS_VERSION = 1

# Copied from config_summary to the top level when present (`pagedq status` reads model/queue).
CONFIG_TOP_LEVEL = ("model", "queue", "queues", "max_num_seqs", "max_num_batched_tokens")


def build_status(
    stats: Any, in_flight: int | Mapping[str, Any], config_summary: Mapping[str, Any]
) -> dict[str, Any]:
    """The status dict of one worker.

    ``stats``: an ``engine.EngineStats``. ``in_flight``: the number of started jobs, or the
    worker's map of them (items with ``enqueued_at`` and ``started_at``, as ``InFlight``), from
    which the mean time in the Redis queue of the jobs in flight is taken. ``config_summary``:
    the settings an operator would change (model, queue, max_num_seqs, kv_cache_memory,
    swap_space, scheduling_policy, tenant_weights, ...), published under ``config``.
    """
    if isinstance(in_flight, Mapping):
        num_in_flight = len(in_flight)
        waits = [
            item.started_at - item.enqueued_at
            for item in in_flight.values()
            if getattr(item, "enqueued_at", None) and getattr(item, "started_at", None)
        ]
        job_queue_time = sum(waits) / len(waits) if waits else None
    else:
        num_in_flight, job_queue_time = int(in_flight), None
    num_swap = getattr(stats, "num_preemptions_swap", 0)
    num_scheduled = getattr(stats, "num_scheduled_requests", 0)
    status: dict[str, Any] = {
        "version": STATUS_VERSION,
        "in_flight": num_in_flight,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "swapped": getattr(stats, "num_swapped", 0),
        "kv_cache_usage": round(stats.kv_cache_usage, 4),
        "num_blocks": stats.num_blocks,
        "num_free_blocks": stats.num_free_blocks,
        # [kind, blocks held] per KV layer group (full attention, a sliding window).
        "kv_blocks_by_group": [list(g) for g in getattr(stats, "kv_blocks_by_group", [])],
        "preemptions": {
            "recompute": getattr(stats, "num_preemptions_recompute", stats.num_preemptions),
            "swap": num_swap,
        },
        "preemption_rate": round(stats.num_preemptions / num_scheduled, 4) if num_scheduled else 0,
        "swapped_out_bytes": getattr(stats, "swapped_out_bytes", 0),
        "avg_swap_bytes": (
            int(getattr(stats, "swapped_out_bytes", 0) / num_swap) if num_swap else 0
        ),
        "swap_space_usage": round(getattr(stats, "swap_space_usage", 0.0), 4),
        "mean_queue_time_s": round(getattr(stats, "mean_queue_time_s", 0.0), 4),
        "job_queue_time_s": round(job_queue_time, 4) if job_queue_time is not None else None,
        "generation_tokens_per_s": round(getattr(stats, "generation_tokens_per_s", 0.0), 2),
        "prefill_tokens_per_s": round(getattr(stats, "prefill_tokens_per_s", 0.0), 2),
        "tenant_generated_tokens": dict(getattr(stats, "tenant_generated_tokens", {})),
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "num_steps": stats.num_steps,
        "num_generated_tokens": stats.num_generated_tokens,
        "num_scheduled_requests": num_scheduled,
        "config": dict(config_summary),
        "updated_at": time.time(),
    }
    for key in CONFIG_TOP_LEVEL:
        if key in config_summary:
            status[key] = config_summary[key]
    return status


class StatusPublisher:
    """Writes one worker's status JSON in one SET with an expiry, often enough to stay fresh.

    `stats_fn()` is the engine's latest stats snapshot, `in_flight_fn()` the worker's in-flight
    jobs (a mapping, or their number). A Redis error is logged (rate-limited) and reported to
    `health`, never raised: the control loop handles Redis outages itself.
    """

    def __init__(
        self,
        connection: redis.Redis,
        worker_name: str,
        config_summary: Mapping[str, Any],
        stats_fn: Callable[[], Any],
        in_flight_fn: Callable[[], int | Mapping[str, Any]],
        interval_s: float = DEFAULT_INTERVAL_S,
        ttl_s: int = DEFAULT_TTL_S,
        health: WorkerHealth | None = None,
    ) -> None:
        self.connection = connection
        self.key = worker_key(worker_name)
        self.config_summary = config_summary
        self.stats_fn = stats_fn
        self.in_flight_fn = in_flight_fn
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.health = health
        self.num_published = 0
        self._next_at = 0.0
        self._last_counts: tuple[int, int, int] | None = None
        self._last_error_log = float("-inf")

    def status(self, stats: Any = None) -> dict[str, Any]:
        """The status JSON as it would be written now (from `stats`, default a fresh snapshot)."""
        stats = self.stats_fn() if stats is None else stats
        return build_status(stats, self.in_flight_fn(), self.config_summary)

    def _counts(self, stats: Any) -> tuple[int, int, int]:
        in_flight = self.in_flight_fn()
        num = len(in_flight) if isinstance(in_flight, Mapping) else int(in_flight)
        return num, stats.num_running, stats.num_waiting

    def maybe_publish(self, now: float | None = None) -> bool:
        """Publish if `interval_s` passed (monotonic `now`) or a count just fell to 0.

        True when it wrote the key. Cheap when it does not: one stats read, no Redis call.
        """
        now = time.monotonic() if now is None else now
        stats = self.stats_fn()
        counts, last = self._counts(stats), self._last_counts
        fell_to_zero = last is not None and any(c == 0 and p != 0 for c, p in zip(counts, last))
        if now < self._next_at and not fell_to_zero:
            return False
        return self._write(stats, counts, now)

    def publish(self, now: float | None = None) -> bool:
        """Publish now, whatever the interval; True when the write succeeded."""
        stats = self.stats_fn()
        return self._write(stats, self._counts(stats), time.monotonic() if now is None else now)

    def _write(self, stats: Any, counts: tuple[int, int, int], now: float) -> bool:
        self._next_at = now + self.interval_s
        # Set even when the write fails: during an outage retry by the interval, not every loop.
        self._last_counts = counts
        try:
            self.connection.set(self.key, json.dumps(self.status(stats)), ex=self.ttl_s)
        except redis.RedisError as exc:
            if self.health is not None:
                self.health.redis_error(f"{type(exc).__name__}: {exc}")
            if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
                self._last_error_log = now
                log.warning("cannot publish worker status", key=self.key, error=str(exc))
            return False
        self.num_published += 1
        if self.health is not None:
            self.health.redis_ok()
        return True

    def clear(self) -> None:
        """Delete the key (a clean stop), so `pagedq status` stops listing this worker."""
        try:
            self.connection.delete(self.key)
        except redis.RedisError as exc:
            log.warning("cannot delete worker status", key=self.key, error=str(exc))

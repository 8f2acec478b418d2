"""The worker's live status key `pagedq:worker:{name}`, read by `pagedq status`.

The control loop calls `maybe_publish()` every iteration; the key is written at most once per
`interval_s` (and at once when the worker empties), from the engine's latest stats snapshot,
so what `pagedq status` shows is never older than about a second of engine time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis
import structlog

from producer.keys import worker_key
from worker.health import WorkerHealth

log = structlog.get_logger("pagedq.worker")

DEFAULT_INTERVAL_S = 0.5
# The key outlives a few missed writes, then vanishes with a dead worker.
DEFAULT_TTL_S = 10
# A failing write is logged at most this often.
ERROR_LOG_INTERVAL_S = 30.0


class StatusPublisher:
    """Writes one worker's status JSON in one SET with an expiry, often enough to stay fresh.

    `extra_fn(stats)` returns more fields to merge in, from the same stats snapshot (e.g.
    `lambda stats: build_status(stats, worker.in_flight, config_summary)` from
    worker/status_report.py); the base fields below win over its keys of the same name. A Redis
    error is logged (rate-limited) and reported to `health`, never raised: the control loop
    handles Redis outages itself.
    """

    def __init__(
        self,
        connection: redis.Redis,
        worker_name: str,
        model: str,
        queue: str,
        stats_fn: Callable[[], Any],
        in_flight_fn: Callable[[], int],
        extra_fn: Callable[[Any], dict[str, Any]] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        ttl_s: int = DEFAULT_TTL_S,
        health: WorkerHealth | None = None,
    ) -> None:
        self.connection = connection
        self.key = worker_key(worker_name)
        self.model = model
        self.queue = queue
        self.stats_fn = stats_fn
        self.in_flight_fn = in_flight_fn
        self.extra_fn = extra_fn
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.health = health
        self.num_published = 0
        self._next_at = 0.0
        self._last_counts: tuple[int, int, int] | None = None
        self._last_error_log = float("-inf")

    def status(self, stats: Any = None) -> dict[str, Any]:
        """The status JSON as it would be written now (from `stats`, default a fresh snapshot)."""
        s = self.stats_fn() if stats is None else stats
        return {
            **(self.extra_fn(s) if self.extra_fn else {}),
            "in_flight": self.in_flight_fn(),
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage,
            "model": self.model,
            "queue": self.queue,
            "updated_at": time.time(),
        }

    def maybe_publish(self, now: float | None = None) -> bool:
        """Publish if `interval_s` passed (monotonic `now`) or a count just fell to 0.

        True when it wrote the key. Cheap when it does not: one stats read, no Redis call.
        """
        now = time.monotonic() if now is None else now
        stats = self.stats_fn()
        counts = (self.in_flight_fn(), stats.num_running, stats.num_waiting)
        last = self._last_counts
        fell_to_zero = last is not None and any(c == 0 and p != 0 for c, p in zip(counts, last))
        if now < self._next_at and not fell_to_zero:
            return False
        return self._write(self.status(stats), counts, now)

    def publish(self, now: float | None = None) -> bool:
        """Publish now, whatever the interval; True when the write succeeded."""
        now = time.monotonic() if now is None else now
        stats = self.stats_fn()
        counts = (self.in_flight_fn(), stats.num_running, stats.num_waiting)
        return self._write(self.status(stats), counts, now)

    def _write(self, status: dict[str, Any], counts: tuple[int, int, int], now: float) -> bool:
        self._next_at = now + self.interval_s
        # Set even when the write fails: during an outage retry by the interval, not every loop.
        self._last_counts = counts
        try:
            self.connection.set(self.key, json.dumps(status), ex=self.ttl_s)
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

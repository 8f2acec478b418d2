"""The control loop's Redis link: rides out outages, buffering writes until Redis is back."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis
import structlog

from worker.rq_adapter import Command, ScriptCall, ScriptRunner

log = structlog.get_logger("pagedq.worker")

# Errors that mean "Redis is not there right now" (down, restarting, loading, failing over).
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError)
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0

Batch = tuple[list[ScriptCall | Command], Callable[[list[Any]], None] | None]


class RedisLink:
    """Runs the loop's Redis calls; while Redis is unreachable, keeps write batches in order.

    Reconnects with exponential backoff (one log line per attempt), then writes every buffered
    batch. The scripts are fenced, so a batch for a job whose lease was lost meanwhile writes
    nothing; EVALSHA after a Redis restart reloads the scripts (NOSCRIPT).
    """

    def __init__(self, scripts: ScriptRunner) -> None:
        self.scripts = scripts
        self.up = True
        self.outbox: deque[Batch] = deque()
        self._attempt = 0
        self._next_attempt_at = 0.0

    def run(self, calls: list[ScriptCall | Command], on_replies=None) -> None:
        """Run a write batch now, or buffer it while Redis is down; on_replies gets the replies."""
        if not calls:
            return
        self.outbox.append((calls, on_replies))
        if self.up:
            self.flush()

    def attempt(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run a read-or-act call that is not worth buffering (dequeue, heartbeat, reap).

        Returns (False, None) when Redis is down (or just went down).
        """
        if not self.up:
            return False, None
        try:
            return True, fn()
        except UNAVAILABLE as exc:
            self._went_down(exc)
            return False, None

    def flush(self) -> None:
        """Write buffered batches in order, stopping at the first connection failure."""
        while self.outbox and self.up:
            calls, on_replies = self.outbox[0]
            try:
                replies = self.scripts.run(calls)
            except UNAVAILABLE as exc:
                self._went_down(exc)
                return
            self.outbox.popleft()
            if on_replies is not None:
                on_replies(replies)

    def poll(self) -> bool:
        """While down, try to reconnect when the backoff allows; True on the reconnecting call."""
        if self.up or time.monotonic() < self._next_attempt_at:
            return False
        self._attempt += 1
        try:
            self.scripts.connection.ping()
        except UNAVAILABLE as exc:
            backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._attempt - 1))
            self._next_attempt_at = time.monotonic() + backoff
            log.warning(
                "redis unreachable, retrying",
                attempt=self._attempt,
                retry_in_s=backoff,
                buffered_batches=len(self.outbox),
                error=str(exc),
            )
            return False
        log.info("redis reconnected", attempts=self._attempt, buffered_batches=len(self.outbox))
        self.up = True
        self._attempt = 0
        self.flush()
        return self.up

    def _went_down(self, exc: Exception) -> None:
        if self.up:
            log.warning("redis connection lost; buffering results", error=str(exc))
        self.up = False
        self._next_attempt_at = time.monotonic() + FIRST_BACKOFF_S

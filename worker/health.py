"""What a worker's `/healthz` says: is the engine thread alive, is Redis reachable."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# Redis may be unreachable this long (a restart, a failover) before the worker reports unhealthy.
DEFAULT_REDIS_GRACE_S = 30.0


class WorkerHealth:
    """Health of one worker from its engine thread and its last Redis round trips.

    The control loop (or the status publisher, see worker/status_publisher.py) reports every
    Redis round trip with `redis_ok()` / `redis_error()`. `report()` says "starting" until the
    engine is attached (the model loads), "unhealthy" when the engine thread is dead or no round
    trip has succeeded for `redis_grace_s` seconds (that also catches a control loop stuck on a
    dead connection), else "ok". Only "ok" is HTTP 200.
    """

    def __init__(
        self,
        model_name: str,
        engine_alive: Callable[[], bool] | None = None,
        last_step_at: Callable[[], float | None] = lambda: None,
        redis_grace_s: float = DEFAULT_REDIS_GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model_name = model_name
        self.engine_alive = engine_alive
        self.last_step_at = last_step_at
        self.redis_grace_s = redis_grace_s
        self.clock = clock
        self._lock = threading.Lock()
        self._redis_ok_at = clock()  # the worker checked Redis just before building this
        self._redis_error: str | None = None

    def attach(
        self, engine_alive: Callable[[], bool], last_step_at: Callable[[], float | None]
    ) -> None:
        """The engine loop exists: judge its thread from now on."""
        self.engine_alive, self.last_step_at = engine_alive, last_step_at

    def redis_ok(self, now: float | None = None) -> None:
        """A Redis round trip succeeded."""
        with self._lock:
            self._redis_ok_at = self.clock() if now is None else now
            self._redis_error = None

    def redis_error(self, error: str) -> None:
        """A Redis round trip failed (the error text is shown on /healthz)."""
        with self._lock:
            self._redis_error = error

    def report(self) -> dict[str, Any]:
        """The /healthz body; `status` is "ok" or "unhealthy" (HTTP 503), with the reasons."""
        now = self.clock()
        with self._lock:
            redis_ok_at, redis_error = self._redis_ok_at, self._redis_error
        starting = self.engine_alive is None
        engine_alive = not starting and bool(self.engine_alive())
        last_step = self.last_step_at()
        redis_silent_s = now - redis_ok_at
        reasons = []
        if starting:
            reasons.append("model loading")
        elif not engine_alive:
            reasons.append("engine thread is dead")
        if redis_silent_s > self.redis_grace_s:
            reasons.append(
                f"no Redis round trip succeeded for {redis_silent_s:.0f} s "
                f"(limit {self.redis_grace_s:.0f} s)"
            )
        report: dict[str, Any] = {
            "status": "starting" if starting else "unhealthy" if reasons else "ok",
            "model": self.model_name,
            "engine_alive": engine_alive,
            "last_step_age_s": round(now - last_step, 3) if last_step is not None else None,
            "redis_connected": redis_error is None and redis_silent_s <= self.redis_grace_s,
            "redis_last_ok_age_s": round(redis_silent_s, 3),
        }
        if redis_error is not None:
            report["redis_error"] = redis_error
        if reasons:
            report["reasons"] = reasons
        return report

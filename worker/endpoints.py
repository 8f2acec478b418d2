"""The worker's HTTP endpoints: what `/healthz` says (engine thread alive, Redis reachable), and
the one small server that serves it beside Prometheus `/metrics`."""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

# Redis may be unreachable this long (a restart, a failover) before the worker reports unhealthy.
DEFAULT_REDIS_GRACE_S = 30.0


class WorkerHealth:
    """Health of one worker from its engine thread and its last Redis round trips.

    The control loop (and the status publisher, worker/status.py) reports every
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


class MetricsPortInUse(OSError):
    """The metrics port is taken; the message says which and what to do."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept"))
            self._send(200, content_type, encoder(self.server.registry))
        elif path == "/healthz":
            report = dict(self.server.health_fn()) if self.server.health_fn else {"status": "ok"}
            code = 200 if report.get("status") == "ok" else 503
            self._send(code, "application/json", json.dumps(report).encode())
        else:
            self._send(404, "text/plain", b"not found: try /metrics or /healthz\n")

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # a scrape every few seconds is not worth a log line


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, registry, health_fn) -> None:
        self.registry = registry
        self.health_fn = health_fn
        super().__init__(address, _Handler)


class MetricsServer:
    """Serves a registry on /metrics and `health_fn()` on /healthz (503 unless status is ok)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health_fn: Callable[[], Mapping[str, Any]] | None,
        host: str,
        port: int,
    ) -> None:
        self.registry = registry
        self.health_fn = health_fn
        self.host = host
        self.port = port
        self._httpd: _Server | None = None

    def start(self) -> MetricsServer:
        """Bind and serve on a daemon thread; `port=0` picks a free port (see `.port`)."""
        try:
            self._httpd = _Server((self.host, self.port), self.registry, self.health_fn)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortInUse(
                    f"metrics port {self.port} on {self.host} is already in use: pass a free "
                    "--metrics-port (each worker on a host needs its own) or 0 to turn it off",
                ) from None
            raise
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

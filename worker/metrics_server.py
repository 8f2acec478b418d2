"""One small HTTP server per worker: Prometheus `/metrics` and `/healthz` on the same port."""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder


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

"""The gateway's ASGI app: routes, error envelope, metrics, and its Redis-side workers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import batches, completions, embeddings, errors, files, models, responses
from gateway.batch_runner import BatchRunner
from gateway.batch_store import BatchStore
from gateway.config import GatewayConfig
from gateway.enqueuer import Enqueuer
from gateway.errors import APIError, error_response
from gateway.file_store import FileStore
from gateway.keys import ACTIVE_BATCHES, batch_key, batch_ref
from gateway.metrics import REGISTRY, ActiveBatches, MetricsMiddleware
from gateway.models import ModelCatalog
from gateway.ratelimit import RateLimiter, RateLimitHeaders
from gateway.stream_hub import StreamHub
from producer.client import Client

# Room for the multipart envelope around a file of the largest allowed size.
MULTIPART_SLACK = 64 * 1024


def create_app(config: GatewayConfig) -> FastAPI:
    """The app for `config`; Redis is reached when it starts (lifespan), not before."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = Client(
            config.redis_url,
            config.queue,
            result_ttl=config.result_ttl,
            # During an outage or failover an HTTP request gets a 503 (Retry-After) instead of
            # waiting it out; the batch runner retries its enqueues on its own.
            outage_timeout=0,
            min_replicas_ack=config.min_replicas_ack,
            replica_ack_timeout_ms=config.replica_ack_timeout_ms,
            queue_shards=config.queue_shards,
        )
        file_store = FileStore(client.redis, config.file_ttl, config.file_chunk_bytes)
        batch_store = BatchStore(
            client.redis, file_store, config.file_ttl, config.queue, config.queue_shards
        )
        hub = StreamHub(config.redis_url)
        runner = BatchRunner(client.redis, client, file_store, batch_store, config)
        app.state.client, app.state.files, app.state.batches = client, file_store, batch_store
        app.state.hub = hub
        app.state.enqueuer = Enqueuer(client, wake=hub.wake_id)
        app.state.catalog = ModelCatalog(hub.redis, config.queue)
        app.state.limiter = RateLimiter(
            hub.redis, app.state.catalog, config.queue, config.max_queue_depth
        )
        collector = ActiveBatches(lambda: _active_statuses(client))
        REGISTRY.register(collector)
        await hub.start()
        runner.start()
        try:
            yield
        finally:
            runner.stop()
            await hub.close()
            REGISTRY.unregister(collector)
            client.close()

    app = FastAPI(title="pagedq gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    errors.install(app)
    for module in (files, batches, completions, models, embeddings, responses):
        app.include_router(module.router)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 when Redis answers, else 503 (the compose healthcheck)."""
        try:
            await request.app.state.hub.redis.ping()
        except (RedisError, OSError):
            return JSONResponse({"status": "redis unreachable"}, status_code=503)
        return JSONResponse({"status": "ok", "open_streams": len(request.app.state.hub)})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics of this gateway."""
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(UploadLimit, max_bytes=config.max_file_bytes + MULTIPART_SLACK)
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(RateLimitHeaders)
    return app


def _active_statuses(client: Client) -> dict[str, int]:
    counts: dict[str, int] = {}
    ids = [raw.decode() for raw in client.redis.smembers(ACTIVE_BATCHES)]
    pipe = client.redis.pipeline(transaction=False)
    for batch_id in ids:
        pipe.hget(batch_key(batch_ref(client.redis, batch_id)), "status")
    for status in pipe.execute() if ids else []:
        if status is not None:
            counts[status.decode()] = counts.get(status.decode(), 0) + 1
    return counts


class UploadLimit:
    """413 before reading a body whose Content-Length is over the largest file allowed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                error = APIError(
                    413,
                    f"request body is over {self.max_bytes} bytes (a batch file may have "
                    f"{self.max_bytes - MULTIPART_SLACK})",
                    code="file_too_large",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

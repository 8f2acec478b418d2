"""GET /v1/models: the models the live workers serve; and which model a request names."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request

from gateway.auth import TenantDep
from gateway.errors import not_found
from producer.contract.keys import WORKER_KEY_PATTERN, root_queue
from producer.contract.models import canonical_model

router = APIRouter()
# The workers' statuses are read at most this often (every request asks for them).
CACHE_S = 2.0
# The chat formats a worker publishes (worker/template_formats.py).
FORMAT_KEYS = ("tool_call_parser", "reasoning_parser")


class ModelCatalog:
    """The models served on the gateway's queue, read from the workers' status keys."""

    def __init__(self, redis: aioredis.Redis, queue: str) -> None:
        self.redis = redis
        self.queue = queue
        self._models: list[dict[str, Any]] = []
        # The live workers' statuses on this queue, as last read (the rate limits size from them).
        self.statuses: list[dict[str, Any]] = []
        self._formats: dict[str, dict[str, str]] = {}
        self._read_at = float("-inf")
        self._reading: asyncio.Future | None = None

    async def models(self) -> list[dict[str, Any]]:
        """[{"id", "created", "owned_by"}] of every model a live worker on the queue serves."""
        if time.monotonic() - self._read_at < CACHE_S:
            return self._models
        # One read for a burst of requests, not one each.
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
        await asyncio.shield(self._reading)
        return self._models

    async def _read(self) -> None:
        found: dict[str, int] = {}
        statuses, formats = [], {}
        async for key in self.redis.scan_iter(match=WORKER_KEY_PATTERN, count=500):
            raw = await self.redis.get(key)
            try:
                info = json.loads(raw) if raw else None
            except ValueError:
                continue
            if not isinstance(info, dict) or not isinstance(info.get("model"), str):
                continue
            if root_queue(str(info.get("queue") or self.queue)) != root_queue(self.queue):
                continue
            statuses.append(info)
            config = info.get("config") if isinstance(info.get("config"), dict) else {}
            formats.setdefault(
                info["model"],
                {k: v for k in FORMAT_KEYS if isinstance(v := config.get(k), str)},
            )
            started = info.get("started_at") or info.get("updated_at") or time.time()
            found.setdefault(info["model"], int(started) if isinstance(started, int | float) else 0)
        self._models = [
            {"id": name, "object": "model", "created": created, "owned_by": "pagedq"}
            for name, created in sorted(found.items())
        ]
        self.statuses, self._formats = statuses, formats
        self._read_at = time.monotonic()

    async def formats(self, model: str) -> dict[str, str]:
        """The reasoning and tool-call parsers the workers serving `model` found in its chat
        template ({} when none serve it)."""
        await self.models()
        return self._formats.get(model, {})

    async def route(self, model: str | None) -> str | None:
        """The served model a request's `model` names (aliases match), else None: such a
        request goes to the shared queue, which every worker serves."""
        if not model:
            return None
        wanted = canonical_model(model)
        for info in await self.models():
            if info["id"] == model or canonical_model(info["id"]) == wanted:
                return info["id"]
        return None


@router.get("/v1/models")
async def list_models(request: Request, _: TenantDep) -> dict[str, Any]:
    """OpenAI's model list."""
    return {"object": "list", "data": await request.app.state.catalog.models()}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request, _: TenantDep) -> dict[str, Any]:
    """One served model; 404 when no live worker serves it."""
    for info in await request.app.state.catalog.models():
        if info["id"] == model_id:
            return info
    raise not_found("model", model_id)

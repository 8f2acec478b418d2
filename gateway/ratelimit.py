"""Backpressure: OpenAI's `x-ratelimit-*` headers on every answer, and 429 past a queue depth.

The limits are what the workers now serving the queue measured they can do (their status keys:
`generation_tokens_per_s` + `prefill_tokens_per_s`, and `max_num_seqs`), per minute, so a
client that paces itself by the headers (curator does) sends about what the workers take.
The requests limit divides the tokens by the mean tokens of the answers this gateway gave.
Remaining counts are this gateway's requests of the last minute, and the room left under
`--max-queue-depth`. An online request that finds more jobs than `--max-queue-depth` waiting
at its priority or ahead of it gets 429 with `retry-after` (the time the workers need to take
the excess, at their measured rate); batch lines are never refused for load.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError
from gateway.models import ModelCatalog
from producer.contract.keys import RQ_QUEUES, rq_queue_key, rq_queue_name

WINDOW_S = 60.0
# The queue depth is read at most this often (every online request asks for it).
DEPTH_CACHE_S = 0.5
# Before any answer was measured: a chat answer's tokens, prompt and output (the engine's
# default max_tokens).
DEFAULT_TOKENS_PER_REQUEST = 512
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 60
# The priority in a sub-queue's name (`{base}:p{priority}[:t:{tenant}]`).
SUBQUEUE_PRIORITY = re.compile(r":p(-?\d+)(?::t:|$)")


@dataclass(frozen=True, slots=True)
class Limits:
    """One snapshot of the headers' numbers."""

    requests: int
    tokens: int
    remaining_requests: int
    remaining_tokens: int
    reset_requests_s: float
    reset_tokens_s: float

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers (resets as "1.5s")."""
        values = {
            "x-ratelimit-limit-requests": str(self.requests),
            "x-ratelimit-limit-tokens": str(self.tokens),
            "x-ratelimit-remaining-requests": str(self.remaining_requests),
            "x-ratelimit-remaining-tokens": str(self.remaining_tokens),
            "x-ratelimit-reset-requests": f"{self.reset_requests_s:.3g}s",
            "x-ratelimit-reset-tokens": f"{self.reset_tokens_s:.3g}s",
        }
        return [(k.encode(), v.encode()) for k, v in values.items()]


class RateLimiter:
    """Sizes the limits from the workers' statuses and refuses online requests past the depth."""

    def __init__(
        self, redis: aioredis.Redis, catalog: ModelCatalog, queue: str, max_queue_depth: int | None
    ) -> None:
        self.redis = redis
        self.catalog = catalog
        self.queue = queue
        self.max_queue_depth = max_queue_depth
        self._admitted: deque[tuple[float, int]] = deque()  # (time, estimated tokens)
        self._tokens_per_request = float(DEFAULT_TOKENS_PER_REQUEST)
        self._depth = 0
        self._depths: list[tuple[int, int]] = []  # (priority, waiting jobs) per sub-queue
        self._depth_at = float("-inf")
        self._reading: asyncio.Future | None = None

    def capacity(self) -> tuple[int, int]:
        """(requests, tokens) a minute that the live workers measured they can do."""
        tokens_per_s, seqs = 0.0, 0
        for status in self.catalog.statuses:
            tokens_per_s += _number(status.get("generation_tokens_per_s"))
            tokens_per_s += _number(status.get("prefill_tokens_per_s"))
            seqs += int(_number(status.get("max_num_seqs")))
        tokens = int(tokens_per_s * WINDOW_S)
        # At least one: a client that divides by the limit (or waits for it) keeps going.
        requests = max(1, seqs, int(tokens / self._tokens_per_request))
        return requests, max(tokens, int(requests * self._tokens_per_request))

    def observe(self, total_tokens: int) -> None:
        """Record an answer's tokens (the mean sizes the requests limit)."""
        if total_tokens > 0:
            self._tokens_per_request += 0.05 * (total_tokens - self._tokens_per_request)

    def limits(self) -> Limits:
        """The numbers the headers carry now."""
        now = time.monotonic()
        while self._admitted and self._admitted[0][0] <= now - WINDOW_S:
            self._admitted.popleft()
        requests, tokens = self.capacity()
        used_tokens = sum(t for _, t in self._admitted)
        remaining = requests - len(self._admitted)
        if self.max_queue_depth is not None:
            remaining = min(remaining, self.max_queue_depth - self._depth)
        reset = self._admitted[0][0] + WINDOW_S - now if self._admitted else 0.0
        return Limits(
            requests=requests,
            tokens=tokens,
            remaining_requests=max(0, remaining),
            remaining_tokens=max(0, tokens - used_tokens),
            reset_requests_s=max(0.0, reset),
            reset_tokens_s=max(0.0, reset),
        )

    async def admit(self, priority: int = 0, tokens: int = DEFAULT_TOKENS_PER_REQUEST) -> None:
        """Count an online request in, or raise 429 (with retry-after) past the queue depth."""
        await self.catalog.models()  # the workers' statuses, read at most every 2 s
        if self.max_queue_depth is not None:
            depth = await self.depth(priority)
            if depth >= self.max_queue_depth:
                raise self._too_many(depth)
        self._admitted.append((time.monotonic(), tokens))

    def _too_many(self, depth: int) -> APIError:
        requests, _ = self.capacity()
        excess = depth - (self.max_queue_depth or 0) + 1
        wait = excess / (requests / WINDOW_S) if requests else MAX_RETRY_AFTER_S
        retry_after = min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(wait)))
        error = APIError(
            429,
            f"{depth} requests are waiting in the queue, the most --max-queue-depth allows is "
            f"{self.max_queue_depth}; retry after {retry_after} s",
            code="rate_limit_exceeded",
        )
        error.headers = {"retry-after": str(retry_after)}
        return error

    async def depth(self, priority: int = 0) -> int:
        """Jobs waiting in the queue at `priority` or ahead of it (all of its models)."""
        if time.monotonic() - self._depth_at >= DEPTH_CACHE_S:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read_depth())
            await asyncio.shield(self._reading)
        return sum(n for p, n in self._depths if p <= priority)

    async def _read_depth(self) -> None:
        # Every RQ queue of this root queue: its models' bases and their (priority, tenant)
        # sub-queues (producer/contract/routing.py names them).
        names = {}
        for key in await self.redis.smembers(RQ_QUEUES):
            name = rq_queue_name(key.decode())
            if name.split(":", 1)[0].split("@", 1)[0] == self.queue:
                match = SUBQUEUE_PRIORITY.search(name)
                names[name] = int(match.group(1)) if match else 0
        names.setdefault(self.queue, 0)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.llen(rq_queue_key(name))
        lengths = await pipe.execute()
        self._depths = list(zip(names.values(), lengths, strict=True))
        self._depth = sum(lengths)
        self._depth_at = time.monotonic()


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0


class RateLimitHeaders:
    """Adds the limiter's x-ratelimit-* headers to every HTTP answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                limiter = getattr(scope["app"].state, "limiter", None)
                if limiter is not None:
                    headers = list(message.get("headers", []))
                    headers += limiter.limits().headers()
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)

"""Riding out Redis outages: retry a Redis call with backoff, one log line per attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import ClusterDownError, NoPermissionError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.refusal import refused_error

T = TypeVar("T")

log = logging.getLogger("pagedq.producer")

# issue 7: producers wait out a Redis restart or failover of at least 5 minutes.
DEFAULT_OUTAGE_S = 600.0
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
# Connection errors of redis-py; BusyLoadingError (Redis replaying its AOF) is one of them.
# A cluster whose primary of a slot is failing over answers CLUSTERDOWN / TRYAGAIN, or has no
# node for the slot in the client's map yet, until a replica is promoted.
REDIS_DOWN = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    SlotNotCoveredError,
    TryAgainError,
)


class RedisUnavailableError(RedisConnectionError):
    """Redis stayed unreachable for longer than the caller was willing to wait."""


def redact_url(url: str) -> str:
    """The Redis URL with its password (and any `*password*` query parameter, e.g. the TLS
    key's `ssl_password`) replaced by ***, fit for logs and error messages (any form: one host,
    a unix socket, or a sentinel URL's list of hosts)."""
    try:
        parts = urlsplit(url)
        if parts.query:
            parts = parts._replace(query=_redact_query(parts.query))
    except ValueError:
        return "<unparsable URL>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not (at and colon):
        return urlunsplit(parts) if parts.query else url
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def _redact_query(query: str) -> str:
    pairs = [p.partition("=") for p in query.split("&")]
    return "&".join(
        f"{k}{eq}***" if eq and "password" in k.lower() else f"{k}{eq}{v}" for k, eq, v in pairs
    )


def backoff_delays(first_s: float = FIRST_DELAY_S, max_s: float = MAX_DELAY_S):
    """0.5, 1, 2, 4, 8, 10, 10, ... seconds."""
    delay = first_s
    while True:
        yield delay
        delay = min(max_s, delay * 2)


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    max_wait_s: float | None = DEFAULT_OUTAGE_S,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, retried with exponential backoff while Redis is unreachable.

    Logs one warning per failed attempt. Gives up with RedisUnavailableError once the outage
    has lasted `max_wait_s` seconds (None: never). A refusal (wrong password, ACL, refused
    certificate) raises RedisRefusedError at once. `fn` must be safe to call again after a
    connection error (reads, or writes that are idempotent like pagedq's enqueue script).
    """
    down_since: float | None = None
    delays = backoff_delays()
    attempt = 0
    while True:
        try:
            result = fn()
        except RedisUnavailableError:
            raise  # a nested wait already gave up: waiting again here would double the limit
        except (*REDIS_DOWN, NoPermissionError) as exc:
            refused = refused_error(exc, f" while {what}")
            if refused is not None:  # a setting to fix, not an outage to wait out
                raise refused from exc
            if not isinstance(exc, REDIS_DOWN):
                raise
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            attempt += 1
            delay = next(delays)
            if max_wait_s is not None and now - down_since + delay > max_wait_s:
                raise RedisUnavailableError(
                    f"Redis unreachable for {now - down_since:.0f} s while {what}: {exc}"
                ) from exc
            log.warning(
                "Redis unreachable while %s (%s); attempt %d, retrying in %.1f s",
                what,
                exc,
                attempt,
                delay,
            )
            sleep(delay)
            continue
        if attempt:
            log.warning("Redis reachable again after %d failed attempt(s) (%s)", attempt, what)
        return result

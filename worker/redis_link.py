"""The worker's link to Redis: script calls sent in batches, reloaded after a restart, and
buffered in order while Redis is unreachable."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.connection import is_cluster, redis_client
from producer.contract.lua import LuaScript
from producer.refusal import refused_error

log = structlog.get_logger("pagedq.worker")

# Errors that mean "Redis cannot take our calls right now": down, restarting, loading, failing
# over, or out of memory under `noeviction` (it refuses writes until memory is freed). A
# cluster whose primary of a slot is failing over says CLUSTERDOWN / TRYAGAIN, or the client
# knows no node for the slot, until a replica takes over.
UNAVAILABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.TryAgainError,
)
# The one maxmemory policy under which Redis never drops a key of ours to make room.
SAFE_MAXMEMORY_POLICY = "noeviction"
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


def raise_if_refused(exc: BaseException) -> None:
    """Raise RedisRefusedError when `exc` is a refusal (wrong password, ACL, certificate): a
    setting to fix, which waiting never cures, unlike the outages of UNAVAILABLE."""
    refused = refused_error(exc)
    if refused is not None:
        raise refused from exc


def connect(url: str, **options: Any) -> redis.Redis:
    """A client for the control loop: no hidden retries (the loop has its own backoff).

    Any URL form of producer/connection.py; with redis+sentinel:// each reconnection asks the
    Sentinels for the current primary (MasterNotFoundError, a ConnectionError, while none is
    known), so a failover is one more outage in UNAVAILABLE. `options` go to the client (a
    benchmark's counting `connection_class`)."""
    return redis_client(
        url,
        retry=Retry(NoBackoff(), 0),
        socket_connect_timeout=5,
        socket_timeout=10,
        health_check_interval=15,
        **options,
    )


def eviction_risk(connection: redis.Redis) -> str | None:
    """Why this Redis may drop pagedq's keys to make room (queued jobs, leases, results), or
    None when it never does or will not say (a managed Redis without CONFIG)."""
    try:
        policy = connection.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.ResponseError:
        return None
    if policy in (None, SAFE_MAXMEMORY_POLICY):
        return None
    return (
        f"Redis's maxmemory-policy is {policy!r}: when memory runs short Redis evicts keys, "
        "queued jobs and results included, and no one is told. Set it to 'noeviction' "
        "(CONFIG SET maxmemory-policy noeviction, or `maxmemory-policy noeviction` in "
        "redis.conf): Redis then refuses writes instead, and pagedq's workers buffer and retry "
        "them. --allow-eviction runs anyway"
    )


@dataclass(slots=True)
class ScriptCall:
    """One EVALSHA to run, alone or in a batch."""

    script: LuaScript
    keys: list[str]
    args: list[Any]


@dataclass(slots=True)
class Command:
    """One plain Redis command to run in a batch (e.g. a cancel-key check); idempotent, as a
    batch cut short by a lost connection runs again."""

    name: str
    args: list[Any]


@dataclass(slots=True)
class SplitCall:
    """One logical call made of several (one per queue shard: each within one hash slot).

    The parts run in one batch and `merge` turns their replies into the one reply; with
    `then`, the call it returns for their replies runs next, alone, and its reply is the reply
    (None: no reply; a dequeue that asks each shard first which one to take from)."""

    parts: list[ScriptCall | Command]
    merge: Callable[[list[Any]], Any] | None = None
    then: Callable[[list[Any]], ScriptCall | None] | None = None


Call = ScriptCall | Command | SplitCall


class ScriptRunner:
    """Runs scripts by EVALSHA; reloads them when Redis answers NOSCRIPT (e.g. after a restart)."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection
        # A cluster runs no MULTI across slots: its batches are plain pipelines, and every
        # write in them is fenced or idempotent.
        self.transaction = not is_cluster(connection)
        self._shas: dict[str, str] = {}

    def call(self, call: Call) -> Any:
        """Run one call now."""
        return self.run([call])[0]

    def run(self, calls: list[Call]) -> list[Any]:
        """Run a batch in one MULTI/EXEC (all or nothing on a lost connection); the replies.
        Commands followed by one script call go as a plain pipeline (see below).

        A script refused with NOSCRIPT did not run, so it is loaded and run again alone.
        Other errors are raised. Connection errors propagate (the caller retries the batch).
        A SplitCall's parts are sent with the rest and their replies merged into one.
        """
        if len(calls) == 1 and not isinstance(calls[0], SplitCall):
            return [self._one(calls[0])]
        if len(calls) == 1 and calls[0].then is not None:
            after = calls[0].then(self.run([SplitCall(calls[0].parts)])[0])
            return [None if after is None else self._one(after)]
        flat: list[ScriptCall | Command] = []
        for c in calls:
            assert not (isinstance(c, SplitCall) and c.then), "a SplitCall with `then` runs alone"
            flat += c.parts if isinstance(c, SplitCall) else [c]
        # Commands (idempotent writes and reads) then one script need no MULTI: a batch cut
        # short by a lost connection ran some commands and not the script, and running it all
        # again is what MULTI would have made of it (and MULTI/EXEC costs Redis a call).
        transaction = self.transaction and not all(isinstance(c, Command) for c in flat[:-1])
        with self.connection.pipeline(transaction=transaction) as pipe:
            for c in flat:
                self._queue(pipe, c)
            replies = pipe.execute(raise_on_error=False)
        for i, reply in enumerate(replies):
            if isinstance(reply, redis.exceptions.NoScriptError):
                replies[i] = self._one(flat[i])
            elif isinstance(reply, Exception):
                raise reply
        out, i = [], 0
        for c in calls:
            if isinstance(c, SplitCall):
                part = replies[i : i + len(c.parts)]
                out.append(c.merge(part) if c.merge else part)
                i += len(c.parts)
            else:
                out.append(replies[i])
                i += 1
        return out

    def load(self, scripts: tuple[LuaScript, ...]) -> None:
        """SCRIPT LOAD each of `scripts` (EVALSHA would load them on first use anyway)."""
        for script in scripts:
            self.connection.script_load(script.source)

    def _sha(self, script: LuaScript) -> str:
        sha = self._shas.get(script.name)
        if sha is None:
            sha = self._shas[script.name] = hashlib.sha1(script.source.encode()).hexdigest()
        return sha

    def _one(self, c: Call) -> Any:
        if isinstance(c, Command):
            return self.connection.execute_command(c.name, *c.args)
        try:
            return self.connection.evalsha(self._sha(c.script), len(c.keys), *c.keys, *c.args)
        except redis.exceptions.NoScriptError:
            self.connection.script_load(c.script.source)
            return self.connection.evalsha(self._sha(c.script), len(c.keys), *c.keys, *c.args)

    def _queue(self, pipe: Any, c: Call) -> None:
        if isinstance(c, Command):
            pipe.execute_command(c.name, *c.args)
        else:
            # Not pipe.evalsha: a cluster pipeline refuses that method, not the command.
            pipe.execute_command("EVALSHA", self._sha(c.script), len(c.keys), *c.keys, *c.args)


Batch = tuple[list[Call], Callable[[list[Any]], None] | None]


class RedisLink:
    """Runs the loop's Redis calls; while Redis is unreachable, keeps write batches in order.

    Reconnects with exponential backoff (one log line per attempt), then writes every buffered
    batch. The scripts are fenced, so a batch for a job whose lease was lost meanwhile writes
    nothing; EVALSHA after a Redis restart reloads the scripts (NOSCRIPT).
    """

    def __init__(self, connection: redis.Redis) -> None:
        self.scripts = ScriptRunner(connection)
        self.up = True
        self.outbox: deque[Batch] = deque()
        self._attempt = 0
        self._next_attempt_at = 0.0

    def run(self, calls: list[Call], on_replies=None) -> None:
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
            try:
                self._write_first()
            except UNAVAILABLE as exc:
                self._went_down(exc)
                return

    def _write_first(self) -> None:
        calls, on_replies = self.outbox[0]
        replies = self.scripts.run(calls)
        self.outbox.popleft()
        if on_replies is not None:
            on_replies(replies)

    def poll(self) -> bool:
        """While down, try to reconnect when the backoff allows; True on the reconnecting call.

        Back means a buffered write went through (or, with nothing buffered, a PING): an
        out-of-memory Redis answers PING but still refuses writes.
        """
        if self.up or time.monotonic() < self._next_attempt_at:
            return False
        self._attempt += 1
        try:
            self.scripts.connection.ping()
            if self.outbox:
                self._write_first()
        except UNAVAILABLE as exc:
            raise_if_refused(exc)
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
        raise_if_refused(exc)
        if self.up:
            log.warning("redis connection lost; buffering results", error=str(exc))
        self.up = False
        self._next_attempt_at = time.monotonic() + FIRST_BACKOFF_S

"""Writes acknowledged by replicas: pipelines that end with Redis WAIT.

WAIT counts the replicas that have the writes of the connection it runs on, so it must follow
the writes on that same connection: it is the last command of the very pipeline that wrote (a
separate call could take another pooled connection, whose WAIT would wait for nothing).
"""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.client import Pipeline

from producer.errors import ReplicaAckError


class AckedPipeline(Pipeline):
    """A non-transactional pipeline whose execute() ends with WAIT replicas timeout_ms and
    raises ReplicaAckError when fewer replicas acknowledged its writes."""

    def __init__(self, *args: Any, replicas: int, timeout_ms: int) -> None:
        super().__init__(*args)
        self.replicas, self.timeout_ms = replicas, timeout_ms

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """The replies of the queued commands (not of the WAIT)."""
        if not self.command_stack:
            return super().execute(raise_on_error)
        if self.transaction or self.explicit_transaction:
            # Inside MULTI, Redis answers WAIT at once, without waiting.
            raise TypeError("WAIT must follow EXEC: use pipeline(transaction=False)")
        self.execute_command("WAIT", self.replicas, self.timeout_ms)
        replies = super().execute(raise_on_error)
        acked = replies.pop()
        if isinstance(acked, Exception):
            raise acked
        if acked < self.replicas:
            raise ReplicaAckError(acked, self.replicas, self.timeout_ms)
        return replies


class ReplicaAckedRedis(Redis):
    """A client on `base`'s connection pool whose pipelines end with WAIT (see AckedPipeline).

    Only pipelines wait: a single command sent through this client does not."""

    def __init__(self, base: Redis, replicas: int, timeout_ms: int) -> None:
        super().__init__(connection_pool=base.connection_pool)
        self.replicas, self.timeout_ms = replicas, timeout_ms

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> AckedPipeline:
        """A pipeline that waits for the replicas once it has written."""
        return AckedPipeline(
            self.connection_pool,
            self.response_callbacks,
            transaction,
            shard_hint,
            replicas=self.replicas,
            timeout_ms=self.timeout_ms,
        )

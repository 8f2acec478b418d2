"""Exceptions raised by the pagedq producer."""

from __future__ import annotations

from collections.abc import Sequence

from redis.exceptions import OutOfMemoryError, RedisError


class InvalidRequestError(ValueError):
    """A job's fields were refused; the message names each field, its value and what is allowed."""

    def __init__(self, message: str, errors: list[dict] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class JobFailedError(RuntimeError):
    """A job ended failed; `error` carries the worker's (or RQ's) failure message."""

    def __init__(self, job_id: str, error: str | None, result: object | None = None) -> None:
        super().__init__(f"job {job_id} failed: {error or 'no error message recorded'}")
        self.job_id = job_id
        self.error = error
        self.result = result


class JobCanceledError(RuntimeError):
    """A job was canceled before it finished."""

    def __init__(self, job_id: str, result: object | None = None) -> None:
        super().__init__(f"job {job_id} was canceled")
        self.job_id = job_id
        self.result = result


class JobNotFoundError(KeyError):
    """No job, result or stream exists in Redis under this id (never submitted, or expired)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id

    def __str__(self) -> str:
        return f"no job {self.job_id!r} in Redis (never submitted, or its result expired)"


class RedisFullError(OutOfMemoryError):
    """Redis refused to queue jobs: it reached its maxmemory under the `noeviction` policy."""

    def __init__(self, error: Exception) -> None:
        super().__init__(
            f"Redis is out of memory and refused to queue jobs ({error}). Jobs of this call "
            "before the refusal may be queued; submitting again is safe for requests with a "
            "custom_id (the same id is the same job). Free memory in Redis (results expire with "
            "their TTL) or raise its maxmemory, then submit again."
        )


class ReplicaAckError(RedisError):
    """Fewer replicas than asked acknowledged an enqueue within the timeout (Redis WAIT).

    The jobs ARE queued on the primary; they are lost only if it dies before replicating them.
    `job_ids` are the jobs of the refused call (empty when not known)."""

    def __init__(
        self, acked: int, wanted: int, timeout_ms: int, job_ids: Sequence[str] = ()
    ) -> None:
        self.acked, self.wanted, self.timeout_ms = acked, wanted, timeout_ms
        self.job_ids = list(job_ids)
        jobs = f"{len(self.job_ids)} job(s)" if self.job_ids else "the jobs"
        super().__init__(
            f"only {acked} of {wanted} replica(s) acknowledged the enqueue within {timeout_ms} "
            f"ms (--min-replicas-ack {wanted}): {jobs} ARE queued on the primary, but would be "
            "lost if it died before replicating them. Submitting the same requests again is "
            "safe for those with a custom_id (the same id is the same job); check the "
            "replicas (INFO replication) or lower --min-replicas-ack."
        )

"""A dequeued job as the worker holds it: its lease member, fencing token and raw RQ fields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.job_data import inflate

# RQ's Job wants a connection even to read its data; this one is never connected.
_NEVER_USED = redis.Redis(host="never-used.invalid")


@dataclass(slots=True)
class Claim:
    """A job this worker dequeued and holds under a lease: its fencing token is `execution`."""

    job_id: str
    queue: str
    execution: str
    attempt: int
    data: bytes
    enqueued_at: str
    timeout: str
    canceled: bool
    started_at: float = field(default_factory=time.time)
    status_was: str = "queued"

    @property
    def member(self) -> str:
        """The job's entry in RQ's started registry (`job_id:execution_id`)."""
        return f"{self.job_id}:{self.execution}"

    def rq_job(self, max_bytes: int) -> Job:
        """An unsaved RQ Job carrying this claim's data, to read its function and arguments.

        The data is JSON (RQ's JSONSerializer), zlib-compressed or not as RQ writes it;
        PayloadTooLargeError (a ValueError) past `max_bytes` once inflated (a zlib bomb stops
        there): the worker's `JobLimits.max_payload_bytes`.
        """
        job = Job(id=self.job_id, connection=_NEVER_USED, serializer=JSONSerializer)
        job.data = inflate(self.data, max_bytes)
        return job

    def timeout_s(self, limit: float) -> float:
        """The job's wall-clock `timeout` in seconds (RQ's field: 90, "90s", "10m", "1h"),
        capped at `limit`; `limit` when absent, malformed, or not positive (RQ's -1 = none)."""
        raw = self.timeout.strip().lower()
        units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
        scale = units.get(raw[-1:], 0) if raw else 0
        try:
            value = float(raw[:-1]) * scale if scale else float(raw)
        except ValueError:
            return limit
        return min(value, limit) if value > 0 else limit

    def enqueued_time(self) -> float:
        """When the job was enqueued (Unix time); ValueError when the hash is malformed."""
        if self.status_was != "queued":
            raise ValueError(f"status: {self.status_was!r}, a queued job has status 'queued'")
        for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
            try:
                return datetime.strptime(self.enqueued_at, fmt).replace(tzinfo=UTC).timestamp()
            except ValueError:
                continue
        raise ValueError(f"enqueued_at: {self.enqueued_at!r} is not an RQ date")

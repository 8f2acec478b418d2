"""Taking a job: what the dequeue script handed over, and the request it validates into.

A claim's raw fields are read here and nowhere else: its data is inflated under the payload
limit and parsed as JSON only (never through RQ's Job, never unpickled or imported), then
checked in order: the function name and argument shape, the wire schema, the model, and this
worker's limits. The model's own limits (vocabulary, context) are the engine's to check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from producer.contract.codec import load_job_data
from producer.contract.keys import GENERATE_FUNC
from producer.contract.models import canonical_model
from producer.contract.schema import GenerationRequest
from producer.errors import InvalidRequestError
from worker.limits import JobLimits


class JobRejected(Exception):
    """A job that can never run (wrong function, bad fields): it fails at once, without retries."""


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
    plain: bool = False  # enqueued by a plain RQ producer, not pagedq's (no pq_ fields)
    bulk: bool = False  # its end goes to an events stream or a batch (no one waits on it alone)
    wake: str = ""  # the stream hub told of its token entries ('' for none)

    @property
    def member(self) -> str:
        """The job's entry in RQ's started registry (`job_id:execution_id`)."""
        return f"{self.job_id}:{self.execution}"

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


def parse_claim(claim: Claim, model_name: str, limits: JobLimits) -> GenerationRequest:
    """The validated request of a claimed job; JobRejected names what is wrong.

    `model_name` is the served model: a job may name it by any alias, GGUF path or hub id.
    """
    try:
        func_name, _, args, kwargs = load_job_data(claim.data, limits.max_payload_bytes)
    except ValueError as exc:  # PayloadTooLargeError too
        raise JobRejected(str(exc)) from None
    if func_name != GENERATE_FUNC:
        raise JobRejected(
            f"job names function {str(func_name)[:80]!r}; a pagedq worker runs only "
            f"{GENERATE_FUNC!r}"
        )
    if not isinstance(kwargs, dict) or not isinstance(args, list):
        raise JobRejected("job arguments must be args=[payload] and kwargs={}")
    if kwargs or len(args) != 1 or not isinstance(args[0], dict):
        raise JobRejected(
            "job arguments must be args=[payload] with payload a JSON object and kwargs={}, "
            f"got {len(args)} args and kwargs {sorted(kwargs)[:10]}"
        )
    try:
        request = GenerationRequest.parse(args[0])
    except InvalidRequestError as exc:
        raise JobRejected(str(exc)) from None
    if request.model is not None and canonical_model(request.model) != canonical_model(model_name):
        raise JobRejected(
            f"model: job asks for {request.model!r} but this worker serves {model_name!r}"
        )
    violation = limits.violation(request)
    if violation is not None:
        raise JobRejected(violation)
    return request

"""Reading a job's end from Redis: the result key, final stream entries, RQ's own state."""

from __future__ import annotations

import time

from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.errors import JobCanceledError, JobFailedError, JobNotFoundError
from producer.keys import result_key
from producer.schema import GenerationResult

FINAL_EVENTS = ("done", "error")
# How long a reader waits for the result key after the final stream entry: the contract has
# workers write the key first, so this only covers a worker that wrote them the other way round.
RESULT_GRACE_S = 2.0


def decode_entry(fields: dict[bytes, bytes]) -> dict[str, str]:
    """A stream entry as str -> str."""
    return {k.decode(): v.decode() for k, v in fields.items()}


def is_final(entry: dict[str, str]) -> bool:
    """True for the done/error entry that ends a job's stream."""
    return entry.get("event") in FINAL_EVENTS


def read_result(connection: Redis, job_id: str) -> GenerationResult | None:
    """The job's result key, parsed, or None when absent."""
    raw = connection.get(result_key(job_id))
    return None if raw is None else GenerationResult.model_validate_json(raw)


def rq_end(connection: Redis, job_id: str, status: str | None) -> dict[str, str] | None:
    """A synthetic final entry for a job RQ ended without a pagedq entry (None if not ended).

    Happens when RQ itself fails a job (e.g. an abandoned job out of retries), when a queued job
    is canceled, or when the job is gone altogether.
    """
    if status is None:
        return {"event": "error", "error": "job not found", "status": "not_found"}
    if status == "finished":
        return {"event": "done", "status": "finished"}
    if status in ("canceled", "stopped"):
        return {"event": "error", "error": "canceled", "status": "canceled"}
    if status != "failed":
        return None
    message = "failed (no message recorded)"
    try:
        latest = Job.fetch(job_id, connection=connection, serializer=JSONSerializer).latest_result()
    except NoSuchJobError:
        latest = None
    if latest is not None and latest.exc_string:
        lines = [line for line in latest.exc_string.strip().splitlines() if line.strip()]
        message = lines[-1] if lines else message
    return {"event": "error", "error": message, "status": "failed"}


def final_result(connection: Redis, job_id: str, entry: dict[str, str]) -> GenerationResult:
    """The GenerationResult of a job whose final entry (real or synthetic) has been read."""
    deadline = time.monotonic() + (RESULT_GRACE_S if entry.get("event") == "done" else 0)
    while True:
        result = read_result(connection, job_id)
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if entry.get("status") == "not_found":
        raise JobNotFoundError(job_id)
    if entry.get("event") == "done":
        return _rq_return_value(connection, job_id)
    canceled = entry.get("status") == "canceled" or entry.get("error") == "canceled"
    status = "canceled" if canceled else "failed"
    return GenerationResult(job_id=job_id, status=status, error=entry.get("error"))


def _rq_return_value(connection: Redis, job_id: str) -> GenerationResult:
    try:
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        value = job.return_value()
    except NoSuchJobError:
        value = None
    if isinstance(value, dict):
        return GenerationResult.model_validate(value)
    return GenerationResult(job_id=job_id, status="failed", error="finished without a result")


def raise_for_status(result: GenerationResult) -> GenerationResult:
    """Return a finished result; raise JobFailedError / JobCanceledError for the others."""
    if result.status == "canceled":
        raise JobCanceledError(result.job_id, result)
    if result.status == "failed":
        raise JobFailedError(result.job_id, result.error, result)
    return result

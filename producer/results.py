"""Reading a job's end from Redis: the result key, final stream entries, RQ's own state.

Everything here reads raw Redis values and parses them as JSON, never through RQ's
`Job.fetch` / `Job.restore` / `Result`: those take a serializer that defaults to pickle, and
inflate zlib data without a bound. Anyone who can write Redis writes what is read here.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from typing import Any

from pydantic import ValidationError
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.connection import mget
from producer.contract.codec import PayloadTooLargeError, inflate, load_job_data
from producer.contract.keys import result_key, rq_job_key, rq_results_key
from producer.contract.schema import GenerationResult
from producer.contract.stream import is_final  # noqa: F401 - where readers import it
from producer.errors import JobCanceledError, JobFailedError, JobNotFoundError

# Largest result, error text or job payload a reader inflates or parses.
MAX_READ_BYTES = 16 * 2**20

# How long a reader waits for the result key after the final stream entry: the contract has
# workers write the key first, so this only covers a worker that wrote them the other way round.
RESULT_GRACE_S = 2.0


def decode_entry(fields: dict[bytes, bytes]) -> dict[str, str]:
    """A stream entry as str -> str."""
    return {k.decode(): v.decode() for k, v in fields.items()}


def read_result(connection: Redis, job_id: str) -> GenerationResult | None:
    """The job's result key, parsed as JSON, or None when absent.

    A value that is not a GenerationResult (written by someone else) reads as a failed result
    saying so, instead of raising in every reader.
    """
    return _parse_result(job_id, connection.get(result_key(job_id)))


def _parse_result(job_id: str, raw: bytes | str | None) -> GenerationResult | None:
    """A result key's value as a GenerationResult (None for a missing key)."""
    if raw is None:
        return None
    if len(raw) > MAX_READ_BYTES:
        return _unreadable(job_id, f"result is over {MAX_READ_BYTES} bytes")
    try:
        return GenerationResult.model_validate_json(raw)
    except ValidationError as exc:
        return _unreadable(job_id, f"result is not a pagedq result ({exc.error_count()} errors)")


def _unreadable(job_id: str, why: str) -> GenerationResult:
    return GenerationResult(job_id=job_id, status="failed", error=f"unreadable result: {why}")


def job_shell(connection: Redis, job_id: str) -> Job | None:
    """An RQ Job for `job_id` that knows only its id and queue (one HGET), for RQ's own
    write operations (cancel, delete); None when the job hash does not exist.

    Unlike `Job.fetch`, nothing stored in the hash is deserialized.
    """
    origin = connection.hget(rq_job_key(job_id), "origin")
    if origin is None:
        return None
    job = Job(connection=connection, serializer=JSONSerializer)
    job._id = job_id  # past RQ's id check, which a shard's hash tag ("{q.0}...") fails
    job.origin = origin.decode(errors="replace")
    return job


def read_job_payload(connection: Redis, job_id: str) -> dict[str, Any]:
    """The job's payload object (its single argument), read as bounded JSON; {} if unreadable."""
    raw = connection.hget(rq_job_key(job_id), "data")
    if raw is None:
        return {}
    try:
        _, _, args, _ = load_job_data(raw, MAX_READ_BYTES)
    except ValueError:
        return {}
    if isinstance(args, list) and len(args) == 1 and isinstance(args[0], dict):
        return args[0]
    return {}


def latest_rq_result(connection: Redis, job_id: str) -> dict[str, Any] | None:
    """RQ's latest result entry of a job, with `return_value` parsed as JSON (None when it is
    not JSON) and `exc_string` inflated (bounded); None when there is no entry."""
    reply = connection.xrevrange(rq_results_key(job_id), "+", "-", count=1)
    if not reply:
        return None
    fields = {k.decode(): v for k, v in reply[0][1].items()}
    out: dict[str, Any] = {"type": fields.get("type", b"").decode(errors="replace")}
    try:
        value = base64.b64decode(fields.get("return_value") or b"", validate=True)
        out["return_value"] = json.loads(value) if value else None
    except (binascii.Error, ValueError):
        out["return_value"] = None
    try:
        raw_exc = base64.b64decode(fields.get("exc_string") or b"", validate=True)
        text = inflate(raw_exc, MAX_READ_BYTES) if raw_exc else b""
        out["exc_string"] = text.decode(errors="replace")
    except (binascii.Error, PayloadTooLargeError):
        out["exc_string"] = ""
    return out


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
    latest = latest_rq_result(connection, job_id)
    if latest is not None and latest["exc_string"]:
        lines = [line for line in latest["exc_string"].strip().splitlines() if line.strip()]
        message = lines[-1][:2000] if lines else message
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


def final_results(
    connection: Redis, ended: list[tuple[str, dict[str, str]]]
) -> dict[str, GenerationResult | JobNotFoundError]:
    """`final_result` of many ended jobs: their result keys in one MGET, then one by one only
    for the jobs without one (RQ's entry, a late write, a job gone). A job gone maps to its
    JobNotFoundError instead of raising, so that one lost job does not hide the others."""
    if not ended:
        return {}
    raws = mget(connection, [result_key(job_id) for job_id, _ in ended])
    out: dict[str, GenerationResult | JobNotFoundError] = {}
    for (job_id, entry), raw in zip(ended, raws, strict=True):
        result = _parse_result(job_id, raw)
        if result is not None:
            out[job_id] = result
            continue
        try:
            out[job_id] = final_result(connection, job_id, entry)
        except JobNotFoundError as exc:
            out[job_id] = exc
    return out


def _rq_return_value(connection: Redis, job_id: str) -> GenerationResult:
    latest = latest_rq_result(connection, job_id)
    value = latest["return_value"] if latest is not None else None
    if isinstance(value, dict):
        try:
            return GenerationResult.model_validate(value)
        except ValidationError:
            return _unreadable(job_id, "RQ's return value is not a pagedq result")
    return GenerationResult(job_id=job_id, status="failed", error="finished without a result")


def raise_for_status(result: GenerationResult) -> GenerationResult:
    """Return a finished result; raise JobFailedError / JobCanceledError for the others."""
    if result.status == "canceled":
        raise JobCanceledError(result.job_id, result)
    if result.status == "failed":
        raise JobFailedError(result.job_id, result.error, result)
    return result

"""Job ids and Redis key names shared by producers and workers: the single source of truth."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

GENERATE_FUNC = "pagedq.generate"
"""The only function name a pagedq job may carry; the worker refuses any other."""

DEFAULT_QUEUE = "pagedq"
DEFAULT_RESULT_TTL = 7 * 24 * 3600
DEFAULT_STREAM_TTL = 24 * 3600
DEFAULT_CANCEL_TTL = 24 * 3600
STREAM_MAXLEN = 10_000

KEY_PREFIX = "pagedq"
CANCEL_CHANNEL = f"{KEY_PREFIX}:cancel"
WORKER_KEY_PATTERN = f"{KEY_PREFIX}:worker:*"


def request_digest(payload: dict[str, Any]) -> str:
    """sha256 hex of a job payload's canonical JSON (sorted keys, no spaces), custom_id left out."""
    body = {k: v for k, v in payload.items() if k != "custom_id"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def job_id_for(
    custom_id: str | None, queue: str = DEFAULT_QUEUE, payload: dict[str, Any] | None = None
) -> str:
    """The job id of a request: derived from `custom_id` (idempotent), else a fresh uuid4 hex.

    With `payload` (what producers always pass) the id is
    "pq-" + sha256(f"{queue}:{custom_id}:{request_digest(payload)}")[:32]: the same custom_id
    with the same request is the same job, with a different request a new job.
    """
    if custom_id is None:
        return uuid.uuid4().hex
    key = f"{queue}:{custom_id}"
    if payload is not None:
        key += ":" + request_digest(payload)
    return "pq-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def result_key(job_id: str) -> str:
    """Key of the plain JSON GenerationResult of a job."""
    return f"{KEY_PREFIX}:result:{job_id}"


def stream_key(job_id: str) -> str:
    """Key of the Redis stream carrying a job's token deltas and its final done/error entry."""
    return f"{KEY_PREFIX}:stream:{job_id}"


def cancel_key(job_id: str) -> str:
    """Key whose presence ("1") asks workers to cancel a job."""
    return f"{KEY_PREFIX}:cancel:{job_id}"


def worker_key(name: str) -> str:
    """Key of a worker's JSON heartbeat {in_flight, running, waiting, kv_cache_usage, ...}."""
    return f"{KEY_PREFIX}:worker:{name}"

"""Job ids and Redis key names shared by producers and workers: the single source of truth."""

from __future__ import annotations

import hashlib
import uuid

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


def job_id_for(custom_id: str | None, queue: str = DEFAULT_QUEUE) -> str:
    """The job id of a request: derived from `custom_id` (idempotent), else a fresh uuid4 hex."""
    if custom_id is None:
        return uuid.uuid4().hex
    digest = hashlib.sha256(f"{queue}:{custom_id}".encode()).hexdigest()
    return "pq-" + digest[:32]


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

"""Job ids: random, or derived from a `custom_id` and the request so resubmission is idempotent."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from producer.contract.keys import DEFAULT_QUEUE


def request_digest(payload: dict[str, Any]) -> str:
    """sha256 hex of a job payload's canonical JSON (sorted keys, no spaces), custom_id and
    stream left out: what the job computes."""
    body = {k: v for k, v in payload.items() if k not in ("custom_id", "stream")}
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

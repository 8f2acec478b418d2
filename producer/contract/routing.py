"""Which RQ queue a job waits in: its model's base queue, then a (priority, tenant) sub-queue.

A base queue is the queue a worker serves (``pagedq`` or ``pagedq@<canonical model>``). Jobs of
priority 0 and no tenant wait in the base queue itself, so a plain RQ producer that pushes there
still works; the others wait in ``{base}:p{priority}``, ``{base}:t:{tenant}`` or
``{base}:p{priority}:t:{tenant}``. Each sub-queue is an ordinary RQ queue (``rq info`` lists
it); the hash ``subqueue_index_key(base)`` indexes the ones that may hold jobs, so a worker's
dequeue script can pick across them: lowest aged priority first, then the tenant with the
smallest virtual finish time (``worker/rq_scripts.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from producer.contract.models import canonical_model

TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""Allowed tenant names: letters, digits, `_`, `.`, `-`; 1 to 64 characters."""

# Estimated tokens of a job without a cost field (a raw producer's): its own default max_tokens.
DEFAULT_JOB_COST = 256


def model_queue(queue: str, model: str | None) -> str:
    """A job's base queue: `{queue}@{canonical model}` when it asks for a model, else `queue`."""
    return queue if model is None else f"{queue}@{canonical_model(model)}"


def subqueue_name(base: str, priority: int = 0, tenant: str | None = None) -> str:
    """The RQ queue name of jobs with this priority and tenant under ``base``."""
    name = base if priority == 0 else f"{base}:p{priority}"
    return name if tenant is None else f"{name}:t:{tenant}"


def subqueue_meta(priority: int = 0, tenant: str | None = None) -> str:
    """The index entry of a sub-queue (JSON)."""
    return json.dumps({"priority": priority, "tenant": tenant or ""}, separators=(",", ":"))


def job_cost(prompt: str | list[int] | None, messages_chars: int, max_tokens: int, n: int) -> int:
    """Estimated tokens of a job, for fair queueing: prompt (~4 chars a token) plus outputs."""
    if isinstance(prompt, list):
        prompt_tokens = len(prompt)
    else:
        prompt_tokens = (len(prompt or "") + messages_chars) // 4
    return prompt_tokens + max_tokens * n


@dataclass(frozen=True, slots=True)
class Routing:
    """Where one job waits and what the fair pick charges for it."""

    base: str  # the base queue (`queue` or `queue@model`)
    queue: str  # the RQ queue it is pushed to (the base or a sub-queue of it)
    meta: str  # its sub-queue's index entry
    cost: int  # estimated tokens
    tenant: str  # "" for none

    @classmethod
    def of(cls, queue: str, payload: dict[str, Any]) -> Routing:
        """The routing of a validated job payload enqueued under `queue`."""
        base = model_queue(queue, payload.get("model"))
        priority, tenant = payload.get("priority", 0), payload.get("tenant")
        messages_chars = sum(len(m.get("content") or "") for m in payload.get("messages") or [])
        cost = job_cost(
            payload.get("prompt"),
            messages_chars,
            payload.get("max_tokens", DEFAULT_JOB_COST),
            payload.get("n", 1),
        )
        return cls(
            base=base,
            queue=subqueue_name(base, priority, tenant),
            meta=subqueue_meta(priority, tenant),
            cost=cost,
            tenant=tenant or "",
        )

"""Which RQ queue a job waits in: one sub-queue per (priority, tenant) under a base queue.

A base queue is the queue a worker serves (e.g. ``pagedq`` or ``pagedq@<model>``). Jobs of
priority 0 and no tenant wait in the base queue itself, so a plain RQ producer that pushes there
still works; the others wait in ``{base}:p{priority}``, ``{base}:t:{tenant}`` or
``{base}:p{priority}:t:{tenant}``. Each sub-queue is an ordinary RQ queue (``rq info`` lists
it); the hash ``pagedq:subqueues:{base}`` indexes the ones that may hold jobs, so a worker's
dequeue script can pick across them: lowest aged priority first, then the tenant with the
smallest virtual finish time (``worker/fair_queue.py``).
"""

from __future__ import annotations

import json
import re

from producer.keys import KEY_PREFIX

TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""Allowed tenant names: letters, digits, `_`, `.`, `-`; 1 to 64 characters."""

# Estimated tokens of a job without a cost field (a raw producer's): its own default max_tokens.
DEFAULT_JOB_COST = 256


def subqueue_name(base: str, priority: int = 0, tenant: str | None = None) -> str:
    """The RQ queue name of jobs with this priority and tenant under ``base``."""
    name = base if priority == 0 else f"{base}:p{priority}"
    return name if tenant is None else f"{name}:t:{tenant}"


def subqueue_index_key(base: str) -> str:
    """Hash of the sub-queues of ``base``: RQ queue name -> {"priority": p, "tenant": t}."""
    return f"{KEY_PREFIX}:subqueues:{base}"


def subqueue_meta(priority: int = 0, tenant: str | None = None) -> str:
    """The index entry of a sub-queue (JSON)."""
    return json.dumps({"priority": priority, "tenant": tenant or ""}, separators=(",", ":"))


def root_queue(base: str) -> str:
    """The queue a base belongs to: ``pagedq@model`` -> ``pagedq`` (accounts are per root)."""
    return base.split("@", 1)[0]


def fair_key(base: str) -> str:
    """Hash of the fair-queueing accounts of a queue: `v` and one `F:{tenant}` per tenant."""
    return f"{KEY_PREFIX}:fair:{root_queue(base)}"


def weights_key(base: str) -> str:
    """Hash of tenant weights of a queue (tenant -> weight; absent = 1), set by workers."""
    return f"{KEY_PREFIX}:fair-weights:{root_queue(base)}"


def tenant_tokens_key(base: str) -> str:
    """Hash of tokens used per tenant of a queue (tenant -> count; "" = no tenant)."""
    return f"{KEY_PREFIX}:tenant-tokens:{root_queue(base)}"


def job_cost(prompt: str | list[int] | None, messages_chars: int, max_tokens: int, n: int) -> int:
    """Estimated tokens of a job, for fair queueing: prompt (~4 chars a token) plus outputs."""
    if isinstance(prompt, list):
        prompt_tokens = len(prompt)
    else:
        prompt_tokens = (len(prompt or "") + messages_chars) // 4
    return prompt_tokens + max_tokens * n

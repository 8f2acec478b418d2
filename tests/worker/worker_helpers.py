"""Helpers for worker tests: real `python -m worker` processes and a producer Client."""

from __future__ import annotations

from worker_process import (
    KV_CACHE_MEMORY,
    LEASE_TTL,
    MODEL,
    REPO,
    WORKER_READY_TIMEOUT,
    WorkerProcess,
)

from producer.client import Client

__all__ = [
    "KV_CACHE_MEMORY",
    "LEASE_TTL",
    "MODEL",
    "REPO",
    "WORKER_READY_TIMEOUT",
    "WorkerProcess",
    "make_client",
]


def make_client(url: str, queue: str) -> Client:
    """A producer Client whose result waits notice ends quickly."""
    return Client(url, queue=queue, check_interval=0.5)

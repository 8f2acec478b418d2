"""Helpers for worker tests: real `python -m worker` processes and a producer Client."""

from __future__ import annotations

import time

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
    "submit_running",
]


def make_client(url: str, queue: str) -> Client:
    """A producer Client whose result waits notice ends quickly."""
    return Client(url, queue=queue, check_interval=0.5)


def submit_running(client: Client, worker: WorkerProcess, count: int, max_tokens: int) -> list:
    """Submit `count` long greedy jobs and wait until `worker` has started every one of them."""
    job_ids = client.submit_many(
        {"prompt": f"Count {i}", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        for i in range(count)
    )
    deadline = time.monotonic() + 60
    while any(client.status(j) != "started" for j in job_ids):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.05)
    return job_ids

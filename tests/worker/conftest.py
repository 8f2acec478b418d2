"""Fixtures for worker tests: a private redis-server per module and real worker processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_process import WorkerProcess

from worker.redis_server import PrivateRedis


@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    """One redis-server on a free port for the whole module."""
    with PrivateRedis() as server:
        yield server


@pytest.fixture(scope="module")
def worker_factory(private_redis: PrivateRedis, tmp_path_factory: pytest.TempPathFactory):
    """Start worker processes on the module's Redis; all are stopped at module end."""
    log_dir = tmp_path_factory.mktemp("worker-logs")
    workers: list[WorkerProcess] = []

    def start(queue: str, name: str, *extra: str, env: dict[str, str] | None = None, **kw):
        w = WorkerProcess(private_redis.url, queue, name, log_dir, *extra, env=env, **kw)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop(timeout=15)

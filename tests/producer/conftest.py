"""Producer fixtures: one real worker process serving a tiny random Llama, for the session.

Tests that need a worker use `served` (its own redis-server, never flushed: tests tell their
jobs apart by id). Tests that must see an exact Redis state with nothing consuming the queue use
the flushed `redis_server`/`redis_client` of tests/conftest.py, where no worker runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_process import WorkerProcess

from producer.client import Client
from worker.redis_server import PrivateRedis

SERVED_QUEUE = "served"
WORKER_NAME = "producer-tests"
STREAM_INTERVAL_S = 0.2


@dataclass
class Served:
    """A redis-server with one real worker serving SERVED_QUEUE with a tiny random model."""

    url: str
    queue: str
    model: str
    worker: WorkerProcess
    redis: Redis

    def client(self, **kwargs) -> Client:
        """A producer Client on the served queue."""
        return Client(self.url, queue=self.queue, check_interval=0.2, **kwargs)

    def fetch(self, job_id: str) -> Job:
        return Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer)

    def executions(self, job_id: str) -> int:
        """How many executions of the job ended in RQ (one Result per finished or failed run)."""
        return len(self.fetch(job_id).results())

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until nothing is queued or started on the served queue."""
        queue = Queue(self.queue, connection=self.redis)
        deadline = time.monotonic() + timeout
        while queue.count or queue.started_job_registry.get_job_count(cleanup=False):
            if time.monotonic() > deadline:
                raise TimeoutError(f"served queue not idle:\n{self.worker.log_tail()}")
            time.sleep(0.05)

    def job_counts(self) -> tuple[int, int]:
        """The worker's RQ counters: (successful_job_count, failed_job_count)."""
        raw = self.redis.hmget(
            f"rq:worker:{WORKER_NAME}", "successful_job_count", "failed_job_count"
        )
        return int(raw[0] or 0), int(raw[1] or 0)


@pytest.fixture(scope="session")
def served(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One worker process for the whole session (tiny model: ready in a few seconds)."""
    model = tiny_llama_dir
    log_dir = tmp_path_factory.mktemp("producer-worker-logs")
    with PrivateRedis() as server:
        worker = WorkerProcess(
            server.url,
            SERVED_QUEUE,
            WORKER_NAME,
            log_dir,
            # RQ's result stream on every job: one entry per run, what `executions` counts.
            "--rq-results",
            "all",
            # Windows longer than a tiny model's steps, even on a loaded machine: several tokens
            # per stream entry (test_client.py counts them).
            "--stream-interval",
            str(STREAM_INTERVAL_S),
            model=model,
            kv_cache_memory="16MiB",
            # 2 cores are shared with pytest: one OpenMP thread avoids oversubscription.
            env={"OMP_NUM_THREADS": "1"},
        )
        connection = Redis.from_url(server.url)
        try:
            worker.wait_ready(timeout=120)
            yield Served(server.url, SERVED_QUEUE, model, worker, connection)
        finally:
            worker.stop(timeout=15)
            connection.close()

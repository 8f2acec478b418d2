"""Gateway fixtures: a real redis-server, a real worker serving a tiny random Llama, and real
`pagedq serve` processes on free ports, driven by OpenAI's own SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gw_helpers import KEYS, QUEUE, GatewayProcess
from openai import OpenAI
from redis import Redis
from worker_process import WorkerProcess

from producer.client import Client
from worker.redis_server import PrivateRedis


@dataclass
class Stack:
    """Redis, one worker and the gateways started on it."""

    redis_url: str
    redis: Redis
    worker: WorkerProcess
    log_dir: Path
    keys_file: Path
    gateways: list[GatewayProcess] = field(default_factory=list)

    def gateway(self, *extra: str, keys: bool = True) -> GatewayProcess:
        """Start one more gateway on the same Redis."""
        gw = GatewayProcess(self.redis_url, self.log_dir, self.keys_file if keys else None, *extra)
        self.gateways.append(gw)
        return gw

    def client(self) -> Client:
        """The Python client on the same queue, for comparisons."""
        return Client(self.redis_url, queue=QUEUE, check_interval=0.2)


@pytest.fixture(scope="session")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One redis-server and one worker for the gateway tests (tiny model: ready in seconds)."""
    log_dir = tmp_path_factory.mktemp("gateway-logs")
    keys_file = log_dir / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    with PrivateRedis() as server:
        worker = WorkerProcess(
            server.url,
            QUEUE,
            "gateway-tests",
            log_dir,
            # RQ's result stream on every job: one entry per run, the witness of "ran once".
            "--rq-results",
            "all",
            # Batch lines' ends written within 50 ms, not gathered for up to 1 s: a test that
            # acts on a batch's counts (cancel once the short lines are done) sees each line end
            # long before a tiny model on a fast host runs a long line to its end.
            "--bulk-coalesce-window",
            "0.05",
            model=tiny_llama_dir,
            kv_cache_memory="16MiB",
            # 2 cores are shared with pytest and the gateways: one OpenMP thread.
            env={"OMP_NUM_THREADS": "1"},
        )
        redis = Redis.from_url(server.url)
        stack = Stack(server.url, redis, worker, log_dir, keys_file)
        try:
            worker.wait_ready(timeout=120)
            yield stack
        finally:
            for gw in stack.gateways:
                gw.stop()
            worker.stop(timeout=15)
            redis.close()


@pytest.fixture(scope="session")
def gateway(stack: Stack) -> GatewayProcess:
    """The session's main gateway (with API keys)."""
    return stack.gateway()


@pytest.fixture
def oai(gateway: GatewayProcess) -> OpenAI:
    """OpenAI's SDK on the main gateway, as tenant team-a."""
    return gateway.openai()

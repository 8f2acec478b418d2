"""A network partition between a worker and Redis (issue 26): the worker's connections are
frozen for 30 s with every byte held and no socket closed, while a second worker, connected
directly, takes over its expired leases. Every job still ends exactly once, and the cut-off
worker notices within its socket timeout and works again afterwards."""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime

import pytest
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from tcp_proxy import TcpProxy
from worker_process import WorkerProcess

from producer.client import Client
from producer.contract.keys import result_key, rq_job_key, worker_key
from worker.redis_link import connect
from worker.redis_server import PrivateRedis

QUEUE = "q-partition"
FREEZE_S = 30.0
JOBS = 20
# Long enough that no job ends between the check that all are running and the freeze.
MAX_TOKENS = 300
# The control loop issues its next Redis call within a loop turn or two of the freeze.
NOTICE_SLACK_S = 5.0
OUTAGE_EVENTS = ("redis connection lost", "cannot publish worker status", "redis unreachable")


def events(worker: WorkerProcess) -> list[dict]:
    """The worker's JSON log lines (--log-format json)."""
    return [json.loads(line) for line in worker.log_path.read_text().splitlines() if line]


def unix_time(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def wait_for(condition, timeout: float, what: str, *workers: WorkerProcess) -> float:
    """Poll until `condition()`; the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            logs = "\n".join(w.log_tail() for w in workers)
            raise AssertionError(f"{what} not within {timeout} s\n{logs}")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def setup(tiny_llama_dir, tmp_path):
    """Redis, a proxy to it, worker A behind the proxy and worker B connected directly."""
    with PrivateRedis() as server:
        proxy = TcpProxy(server.port)
        common = {"model": tiny_llama_dir, "kv_cache_memory": "16MiB",
                  "env": {"OMP_NUM_THREADS": "1"}}  # fmt: skip
        # RQ's result stream on every job: one entry per end, the witness of "ended once".
        flags = ("--log-format", "json", "--rq-results", "all")
        behind = WorkerProcess(proxy.url, QUEUE, "w-behind", tmp_path, *flags, **common)
        direct = WorkerProcess(server.url, QUEUE, "w-direct", tmp_path, *flags, **common)
        try:
            behind.wait_ready(timeout=120)
            direct.wait_ready(timeout=120)
            yield server, proxy, behind, direct
        finally:
            proxy.resume()
            for w in (behind, direct):
                w.stop(timeout=15)
            proxy.close()


@pytest.mark.parametrize("heal", ["resume", "cut"])
def test_every_job_ends_once_across_a_30_s_partition(setup, heal):
    """`resume` delivers the held bytes late (a request the worker gave up on still runs);
    `cut` drops them and closes every connection through the proxy."""
    server, proxy, behind, direct = setup
    redis = server.client()
    socket_timeout = connect(proxy.url).connection_pool.connection_kwargs["socket_timeout"]
    client = Client(server.url, queue=QUEUE, check_interval=0.2)

    def held_by(name: str) -> list[str]:
        """The jobs under a lease of worker `name` (started registry members: id:execution)."""
        started = StartedJobRegistry(QUEUE, connection=redis).get_job_ids(cleanup=False)
        job_ids = [member.rsplit(":", 1)[0] for member in started]
        return [j for j in job_ids if redis.hget(rq_job_key(j), "worker_name") == name.encode()]

    # B sleeps while A takes every job, so that the freeze catches all of them in flight.
    with direct.paused():
        job_ids = client.submit_many(
            {"prompt": f"Partition {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
            for i in range(JOBS)
        )
        wait_for(lambda: len(held_by(behind.name)) == JOBS, 60, "A takes every job", behind)
        proxy.freeze()
        frozen_at = time.time()
    assert len(held_by(behind.name)) == JOBS  # none ended before the freeze

    time.sleep(FREEZE_S - (time.time() - frozen_at))
    getattr(proxy, heal)()
    healed_at = time.time()

    # B ran the jobs whose leases A lost; A's late writes are refused by the fence.
    finished = FinishedJobRegistry(QUEUE, connection=redis)
    wait_for(lambda: finished.get_job_count(cleanup=False) == JOBS, 60, "all jobs end",
             behind, direct)  # fmt: skip

    # A noticed the partition within its socket timeout, while it lasted.
    notices = [unix_time(e) - frozen_at for e in events(behind)
               if e["event"].startswith(OUTAGE_EVENTS) and unix_time(e) >= frozen_at]  # fmt: skip
    assert notices, behind.log_tail()
    noticed_after = min(notices)
    print(f"A noticed after {noticed_after:.1f} s (socket_timeout {socket_timeout} s)")
    assert noticed_after <= min(FREEZE_S, socket_timeout + NOTICE_SLACK_S), behind.log_tail()

    # A does not hang: its status key is written again soon after the partition heals.
    def status_age() -> float:
        raw = redis.get(worker_key(behind.name))
        return time.time() - json.loads(raw)["updated_at"] if raw else float("inf")

    wait_for(lambda: status_age() < 1.0, socket_timeout + 5, "A's status", behind)
    print(f"A's status fresh again {time.time() - healed_at:.1f} s after the {heal}")

    # Every job ended exactly once: one end log line, one RQ result, one result key.
    ended = Counter(
        e["job_id"] for w in (behind, direct) for e in events(w) if e["event"] == "job ended"
    )
    assert ended == Counter(job_ids), (ended, job_ids)
    for job_id in job_ids:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
        assert job.get_status() == "finished"
        assert len(job.results()) == 1
        assert redis.exists(result_key(job_id))
    assert Queue(QUEUE, connection=redis).count == 0
    assert StartedJobRegistry(QUEUE, connection=redis).get_job_count(cleanup=False) == 0
    assert FailedJobRegistry(QUEUE, connection=redis).get_job_count(cleanup=False) == 0

    # And A takes and ends jobs again.
    with direct.paused():
        more = client.submit_many({"prompt": f"After {i}", "max_tokens": 4} for i in range(3))
        for job_id in more:
            assert client.result(job_id, timeout=30).worker == behind.name
    client.close()

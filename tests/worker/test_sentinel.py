"""Redis Sentinel: workers and producers on a redis+sentinel:// URL ride out a real failover (a
SIGKILLed primary, a replica promoted by three Sentinels), and every job ends exactly once."""

from __future__ import annotations

import hashlib
import time

import pytest
from sentinel_cluster import SentinelCluster, wait_until
from worker_process import WorkerProcess

from producer.client import Client
from producer.contract.keys import rq_job_key, rq_queue_key
from worker.redis_link import UNAVAILABLE, RedisLink, connect
from worker.rq_adapter import RQAdapter
from worker.rq_scripts import END

QUEUE = "q-sentinel"
JOBS = 200
# Longer than the outage (Sentinels' 1 s judgement, the vote, the workers' reconnect backoff),
# so a lease runs out only when the write that made it was lost with the old primary.
LEASE_TTL = 10
# Each admission sleeps this long: the 200 jobs take seconds, and the kill lands among them.
# A pause after each dequeue call (each takes up to 8 jobs): the run lasts past the kill.
THROTTLE = {"PAGEDQ_TEST_SLEEP_AFTER_DEQUEUE": "0.15", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def cluster():
    with SentinelCluster() as c:
        yield c


def reconnect(link: RedisLink, timeout: float) -> None:
    """Poll the link until it is up again, skipping its backoff (the test waits on its own)."""
    deadline = time.monotonic() + timeout
    while not link.up:
        assert time.monotonic() < deadline, "the link did not reconnect"
        link._next_attempt_at = 0.0
        link.poll()
        time.sleep(0.2)


def test_a_failover_is_an_outage_to_the_worker_link_and_the_scripts_load_again(cluster):
    client = Client(cluster.url, QUEUE, min_replicas_ack=1)
    job_id = client.submit(prompt="hi", max_tokens=2)
    connection = connect(cluster.url)
    adapter = RQAdapter(connection, "w-link", [QUEUE], lease_ttl=30, result_ttl=60,
                        stream_ttl=60, max_crashes=2)  # fmt: skip
    link = RedisLink(connection)
    call, started_at = adapter.dequeue_call()
    [claim] = adapter.claims(link.scripts.call(call), started_at)
    assert claim.job_id == job_id
    (replica,) = cluster.replicas_of(cluster.primary_port())
    started = lambda: replica.client().hget(rq_job_key(job_id), "status") == b"started"
    wait_until(started, 10, "the start to replicate")

    old = cluster.kill_primary()
    with pytest.raises(UNAVAILABLE):  # refused, then MasterNotFoundError: no primary known
        connection.ping()
    result = f'{{"job_id": "{job_id}", "status": "finished"}}'
    link.run([adapter.end_call(claim, "finished", result, (1, 1), {"event": "done"})])
    assert not link.up and len(link.outbox) == 1  # buffered, as for any outage

    new = cluster.wait_failover(old)
    end_sha = hashlib.sha1(END.source.encode()).hexdigest()
    assert cluster.servers[new].client().script_exists(end_sha) == [False]  # NOSCRIPT ahead
    reconnect(link, 20)
    assert not link.outbox
    assert cluster.servers[new].client().hget(rq_job_key(job_id), "status") == b"finished"


def test_an_enqueue_during_a_failover_waits_for_the_new_primary(cluster):
    client = Client(cluster.url, QUEUE)
    assert client.submit(prompt="before", max_tokens=2)
    old = cluster.kill_primary()
    t0 = time.monotonic()
    job_id = client.submit(prompt="during", custom_id="during-1", max_tokens=2)
    waited = time.monotonic() - t0
    new = cluster.primary_port()
    assert new != old and waited > 0.5
    assert cluster.servers[new].client().hget(rq_job_key(job_id), "status") == b"queued"
    assert client.submit(prompt="during", custom_id="during-1", max_tokens=2) == job_id
    assert cluster.servers[new].client().llen(rq_queue_key(QUEUE)) == 2


def _jobs(n: int, tag: str) -> list[dict]:
    return [
        {"prompt": f"{tag} {i}: say something", "max_tokens": 2 + i % 3, "temperature": 0}
        for i in range(n)
    ]


@pytest.mark.parametrize("unreplicated", [False, True], ids=["kill", "kill-losing-writes"])
def test_two_workers_ride_out_a_failover_and_every_job_ends_exactly_once(
    cluster, tiny_llama_dir, tmp_path, unreplicated
):
    """With `unreplicated`, the replica misses the primary's last 0.4 s: ends written then are
    lost (their jobs run again once their leases run out), and so are starts (their jobs are
    queued again on the new primary, and the first runs' ends are fenced off)."""
    workers = [
        # RQ's result stream on every job: one entry per end, the witness of "ended once".
        WorkerProcess(cluster.url, QUEUE, f"w-sentinel-{i}", tmp_path, "--rq-results", "all",
                      model=tiny_llama_dir, lease_ttl=LEASE_TTL, env=THROTTLE)
        for i in range(2)
    ]  # fmt: skip
    pids = [w.process.pid for w in workers]
    client = Client(cluster.url, QUEUE, check_interval=0.5, min_replicas_ack=1)
    try:
        for w in workers:
            w.wait_ready(timeout=300)
        job_ids = client.submit_many(_jobs(JOBS, "before"))
        primary = cluster.primary.client()
        finished = f"rq:finished:{QUEUE}"
        wait_until(lambda: primary.zcard(finished) >= 30, 120, "30 jobs to finish")
        if unreplicated:
            cluster.freeze_replication()
            time.sleep(0.4)
        finished_at_kill = primary.zcard(finished)
        old = cluster.kill_primary()
        assert finished_at_kill < JOBS - 20, "the jobs ran too fast: the kill came after them"
        new = cluster.wait_failover(old)
        admin = cluster.servers[new].client()
        if unreplicated:
            assert admin.zcard(finished) < finished_at_kill  # those ends died with the primary

        results = [client.result(j, timeout=120) for j in job_ids]
        assert [r.status for r in results] == ["finished"] * JOBS, [r.error for r in results]
        assert admin.zcard(finished) == JOBS
        assert set(admin.zrange(finished, 0, -1)) == {j.encode() for j in job_ids}
        # One RQ result entry per job: no job ended twice (a replayed END is fenced).
        assert [admin.xlen(f"rq:results:{j}") for j in job_ids] == [1] * JOBS
        assert admin.zcard(f"rq:failed:{QUEUE}") == 0

        # The same processes serve on, with the old primary back as the new one's replica.
        cluster.rejoin_as_replica(old)
        extra = client.submit_many(_jobs(5, "after"))
        assert [client.result(j, timeout=60).status for j in extra] == ["finished"] * 5
        assert [w.process.poll() for w in workers] == [None, None]
        assert [w.process.pid for w in workers] == pids
        assert admin.zcard(finished) == JOBS + 5
        for w in workers:
            log = w.log_tail(1_000_000)
            assert "redis connection lost" in log and "redis reconnected" in log, log[-3000:]
    finally:
        client.close()
        for w in workers:
            w.stop(timeout=20)

"""Two real workers on one queue: shared work, a SIGKILLed worker's jobs re-run, clean SIGTERM."""

from __future__ import annotations

import json
import time

import pytest
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from worker_helpers import make_client

from producer.contract.keys import rq_job_key

pytestmark = pytest.mark.slow

QUEUE = "q-scale"
# Few slots per worker, so a burst of jobs has to spread over both; a drain long enough for the
# SIGTERM test's long jobs on a slow, loaded host (they took over 30 s, the default, there).
SLOTS = ("--max-num-seqs", "6", "--drain-timeout", "150")
# Tokens of the jobs whose claims ahead the tests watch: long enough that a worker's slots stay
# full across several of its status keys (written every 0.5 s), on a fast host too.
LONG = 48


@pytest.fixture(scope="module")
def workers(worker_factory):
    # RQ's result stream on every job: one entry per end, the witness of "ended once".
    a = worker_factory(QUEUE, "w-a", *SLOTS, "--rq-results", "all")
    b = worker_factory(QUEUE, "w-b", *SLOTS, "--rq-results", "all")
    a.wait_ready()
    b.wait_ready()
    return a, b


@pytest.fixture(scope="module")
def client(private_redis):
    c = make_client(private_redis.url, QUEUE)
    yield c
    c.close()


def _successes(client, job_id: str) -> list[Result]:
    job = Job.fetch(job_id, connection=client.redis, serializer=JSONSerializer)
    return [r for r in job.results() if r.type == Result.Type.SUCCESSFUL]


def _held_by(client, worker_name: str) -> set[str]:
    """Job ids in the queue's started registry whose job hash names this worker."""
    members = client.redis.zrange(f"rq:wip:{QUEUE}", 0, -1)
    job_ids = [m.decode().rsplit(":", 1)[0] for m in members]
    names = [client.redis.hget(f"rq:job:{j}", "worker_name") for j in job_ids]
    return {j for j, n in zip(job_ids, names, strict=True) if n == worker_name.encode()}


def _jobs(n: int, tag: str, max_tokens: int = 8) -> list[dict]:
    """`n` jobs of `max_tokens` to twice as many tokens."""
    return [
        {"prompt": f"{tag} {i}: list some words", "temperature": 0.0, "ignore_eos": True,
         "max_tokens": max_tokens + i % 3 * max_tokens // 2}
        for i in range(n)
    ]  # fmt: skip


def test_two_workers_share_the_queue_and_every_job_ends_once(workers, client):
    a, b = workers
    job_ids = client.submit_many(_jobs(24, "share"))
    results = [client.result(j, timeout=240) for j in job_ids]

    assert {r.worker for r in results} == {a.name, b.name}
    assert all(r.status == "finished" for r in results)
    for job_id in job_ids:
        assert len(_successes(client, job_id)) == 1
    finished = FinishedJobRegistry(QUEUE, connection=client.redis, serializer=JSONSerializer)
    failed = FailedJobRegistry(QUEUE, connection=client.redis, serializer=JSONSerializer)
    assert set(job_ids) <= set(finished.get_job_ids())
    assert failed.count == 0


def test_busy_workers_claim_bulk_jobs_ahead_and_every_job_ends_once(workers, client):
    """--prefetch (default: a quarter of the requests running, here 1 of 6): from a deep queue
    of bulk jobs each busy worker holds more jobs than it runs, and each job still ends once."""
    from producer.contract.schema import GenerationRequest

    requests = [GenerationRequest.model_validate(j) for j in _jobs(32, "ahead", LONG)]
    job_ids = client.enqueue(requests, notify="ahead-run")
    held, deadline = [], time.monotonic() + 240
    while any(client.status(j) != "finished" for j in job_ids[:-8]):
        assert time.monotonic() < deadline, workers[0].log_tail()
        for w in workers:  # the status key each worker publishes every 0.5 s
            if status := client.redis.get(f"pagedq:worker:{w.name}"):
                held.append(json.loads(status)["in_flight"])
        time.sleep(0.1)

    assert max(held) == 7  # 6 running and 1 claimed ahead, never more
    assert all(client.result(j, timeout=120).status == "finished" for j in job_ids)
    for job_id in job_ids:
        assert len(_successes(client, job_id)) == 1


def test_jobs_of_a_killed_worker_run_again_elsewhere_and_end_once(workers, client):
    a, b = workers
    job_ids = client.submit_many(_jobs(18, "kill"))
    deadline = time.monotonic() + 120
    while len(_held_by(client, a.name)) < 2:
        assert time.monotonic() < deadline, a.log_tail()
        time.sleep(0.02)
    a.kill()  # SIGKILL mid-batch: no cleanup, its leases just stop being renewed
    orphans = _held_by(client, a.name)
    assert orphans <= set(job_ids) and orphans

    results = {j: client.result(j, timeout=240) for j in job_ids}
    assert all(r.status == "finished" for r in results.values())
    for job_id in orphans:
        assert results[job_id].worker == b.name
        # The re-run did not repeat in the stream what the dead worker had already streamed.
        assert "".join(client.stream(job_id, timeout=10)) == results[job_id].text
    for job_id in job_ids:
        assert len(_successes(client, job_id)) == 1
    failed = FailedJobRegistry(QUEUE, connection=client.redis, serializer=JSONSerializer)
    assert failed.count == 0


def test_sigterm_lets_in_flight_jobs_finish_then_exits_cleanly(workers, client, worker_factory):
    """A warm stop: the running jobs finish, the job claimed ahead (not begun) goes back to the
    front of the queue at once (a worker started after runs it); every job ends once."""
    from producer.contract.schema import GenerationRequest

    _, b = workers  # the only one left: the previous test killed the other
    # The first 7 (6 run, 1 claimed ahead) long: a job that ended and waits for its batched END
    # still reads "started" in its hash, so with short jobs "7 started" could be 6 running and
    # 1 ended, with nothing claimed ahead to hand back.
    jobs = _jobs(7, "drain", 2 * LONG) + _jobs(23, "drain-rest")
    requests = [GenerationRequest.model_validate(j) for j in jobs]
    job_ids = client.enqueue(requests, notify="drain-run")
    deadline = time.monotonic() + 120

    def started() -> int:
        pipe = client.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(rq_job_key(job_id), "status")
        return sum(status == b"started" for status in pipe.execute())

    # 6 running, 1 claimed ahead: read from the job hashes (the worker's status key, written
    # every 2 s, could miss the few seconds a fast host needs for all 30 jobs).
    while started() != 7:
        assert time.monotonic() < deadline, b.log_tail()
        time.sleep(0.02)

    assert b.stop(timeout=180) == 0
    assert "jobs not begun handed back" in b.log_tail(100_000)
    assert "requeueing unfinished jobs" not in b.log_tail(100_000)  # the drain ran them all
    assert f"rq:worker:{b.name}".encode() not in client.redis.smembers("rq:workers")
    assert client.redis.get(f"pagedq:worker:{b.name}") is None
    by_b = {j for j in job_ids if client.status(j) == "finished"}
    assert 6 <= len(by_b) < len(job_ids)  # what b ran ended; the rest waits, none lost
    assert client.redis.llen(f"rq:queue:{QUEUE}") == len(job_ids) - len(by_b)

    c = worker_factory(QUEUE, "w-c", *SLOTS, "--rq-results", "all")
    results = {j: client.result(j, timeout=240) for j in job_ids}
    assert all(r.status == "finished" for r in results.values())
    assert {results[j].worker for j in by_b} == {b.name}
    assert {results[j].worker for j in set(job_ids) - by_b} == {c.name}
    for job_id in job_ids:
        assert len(_successes(client, job_id)) == 1

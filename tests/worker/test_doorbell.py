"""The doorbell (worker/doorbell.py): producers ring a base queue's bell as they enqueue, a
DEQUEUE that leaves jobs rings once more, so does a job put back, and a worker with room waits
for a ring instead of polling its empty queue; a real worker asks an empty queue about every
SAFETY_POLL_S only."""

from __future__ import annotations

import hashlib
import time

from redis_monitor import CommandLog
from worker_helpers import make_client

from producer.contract.keys import BELL_MAX, bell_key
from producer.contract.schema import GenerationRequest
from worker.doorbell import SAFETY_POLL_S, Doorbell
from worker.redis_link import ScriptRunner
from worker.rq_adapter import RQAdapter
from worker.rq_scripts import DEQUEUE

QUEUE = "q-bell"
DEQUEUE_SHA = hashlib.sha1(DEQUEUE.source.encode()).hexdigest()


def _requests(n: int, tag: str) -> list[GenerationRequest]:
    return [GenerationRequest.model_validate({"prompt": f"{tag} {i}"}) for i in range(n)]


def test_producers_ring_once_per_eight_jobs_and_a_dequeue_that_leaves_jobs_rings_again(
    private_redis,
):
    r = private_redis.client()
    client = make_client(private_redis.url, "q-bell-rings")
    bell = bell_key("q-bell-rings")
    client.enqueue(_requests(20, "a"))
    assert r.llen(bell) == 3  # ceil(20 / 8): three workers woken, each takes up to 8
    client.enqueue(_requests(2000, "b"))
    assert r.llen(bell) == BELL_MAX  # capped
    assert 0 < r.ttl(bell) <= 3600
    r.delete(bell)
    adapter = RQAdapter(r, "w-bell", ["q-bell-rings"], lease_ttl=30, result_ttl=600,
                        stream_ttl=600, max_crashes=2)  # fmt: skip
    scripts = ScriptRunner(r)
    call, started_at = adapter.dequeue_call(4)
    assert len(adapter.claims(scripts.call(call), started_at)) == 4
    assert r.llen(bell) == 1  # jobs are left: another waiting worker is woken
    call, started_at = adapter.dequeue_call(4)
    claims = adapter.claims(scripts.call(call), started_at)
    assert r.llen(bell) == 1  # a ring already waits: not one more
    # A job put back (a worker stopping) rings for itself.
    r.delete(bell)
    call = adapter.requeue_call(claims[0], count_crash=False, result_json="{}", reason="stop")
    assert scripts.call(call) == 1
    assert r.llen(bell) == 1


def test_the_bell_is_taken_only_while_the_worker_wants_work(private_redis):
    r = private_redis.client()
    bell = Doorbell(r, [bell_key("q-bell-want")])
    bell.start()
    try:
        r.rpush(bell_key("q-bell-want"), "1")
        time.sleep(1.5)
        assert r.llen(bell_key("q-bell-want")) == 1 and not bell.rang.is_set()
        bell.want(True)
        assert bell.rang.wait(5)
        assert r.llen(bell_key("q-bell-want")) == 0
        # One ring wakes one waiting worker: this one takes no more until it wants again.
        r.rpush(bell_key("q-bell-want"), "1")
        time.sleep(1.5)
        assert r.llen(bell_key("q-bell-want")) == 1
    finally:
        bell.stop()


def test_an_idle_worker_waits_for_a_ring_and_takes_the_job_it_rings_for(
    private_redis, worker_factory
):
    worker = worker_factory(QUEUE, "w-doorbell")
    worker.wait_ready()
    client = make_client(private_redis.url, QUEUE)
    time.sleep(1.0)  # it found its queue empty: now it waits
    log = CommandLog(private_redis.client())
    time.sleep(4.0)
    # Polling, an idle worker asked every 0.25 s (16 calls in 4 s); waiting, every 2 s.
    calls = [w for w in log.words("evalsha") if w[1] == DEQUEUE_SHA]
    assert len(calls) <= 4.0 / SAFETY_POLL_S + 1
    job_id = client.enqueue(_requests(1, "rung"))[0]
    assert client.result(job_id, timeout=60).status == "finished"
    assert private_redis.client().llen(bell_key(QUEUE)) == 0

"""The fair pick in a real redis-server: priority with aging, then tenant virtual finish times."""

from __future__ import annotations

import time
from collections import Counter

from fair_pick import FairQueue

from producer.contract.keys import (
    JOB_FIELDS,
    rq_job_key,
    rq_queue_key,
    subqueue_index_key,
    tenant_tokens_key,
)
from producer.contract.routing import subqueue_meta, subqueue_name

BASE = "pq-test"


def push(r, job_id, priority=0, tenant=None, cost=10, waited=0.0):
    """Queue a bare job id as a producer would, enqueued `waited` seconds ago."""
    name = subqueue_name(BASE, priority, tenant)
    fields = {
        "status": "queued",
        JOB_FIELDS["enqueued"]: time.time() - waited,
        JOB_FIELDS["cost"]: cost,
    }
    r.hset(rq_job_key(job_id), mapping=fields)
    r.rpush(rq_queue_key(name), job_id)
    r.hset(subqueue_index_key(BASE), name, subqueue_meta(priority, tenant))


def picks(fq, count):
    out = []
    for _ in range(count):
        got = fq.pick()
        if got is None:
            break
        out.append(got[1])
    return out


def test_subqueue_names():
    assert subqueue_name("q") == "q"
    assert subqueue_name("q", 5) == "q:p5"
    assert subqueue_name("q", 0, "a") == "q:t:a"
    assert subqueue_name("q", -1, "a") == "q:p-1:t:a"


def test_priority_zero_jumps_two_hundred_priority_five_jobs(redis_client):
    for i in range(200):
        push(redis_client, f"low{i}", priority=5)
    push(redis_client, "urgent", priority=0)
    fq = FairQueue(redis_client, [BASE], aging_seconds=60)
    assert picks(fq, 3) == ["urgent", "low0", "low1"]


def test_aged_job_starts_within_the_stated_bound(redis_client):
    # Bound: (p - p_min + 1) * aging_seconds = (9 - 0 + 1) * 1 s = 10 s of waiting.
    for i in range(5):
        push(redis_client, f"fresh{i}", priority=0)
    push(redis_client, "old9", priority=9, waited=10.5)
    push(redis_client, "young9", priority=9, waited=5.0)
    fq = FairQueue(redis_client, [BASE], aging_seconds=1)
    order = picks(fq, 7)
    assert order[0] == "old9"
    assert order.index("young9") == 6  # its effective priority is still 4: after every fresh 0


def test_late_tenant_is_served_at_once_not_after_the_backlog(redis_client):
    for i in range(300):
        push(redis_client, f"a{i}", tenant="A")
    fq = FairQueue(redis_client, [BASE])
    assert picks(fq, 50) == [f"a{i}" for i in range(50)]
    for i in range(10):
        push(redis_client, f"b{i}", tenant="B")
    order = picks(fq, 20)
    assert sorted(j for j in order if j.startswith("b")) == sorted(f"b{i}" for i in range(10))
    assert sum(j.startswith("a") for j in order) == 10


def test_token_shares_follow_weights(redis_client):
    for i in range(300):
        push(redis_client, f"a{i}", tenant="A", cost=30)
        push(redis_client, f"b{i}", tenant="B", cost=20)
    fq = FairQueue(redis_client, [BASE])
    fq.set_weights({"A": 2, "B": 1})
    tokens = Counter()
    for job_id in picks(fq, 200):
        tokens[job_id[0]] += 30 if job_id[0] == "a" else 20
    share_a = tokens["a"] / (tokens["a"] + tokens["b"])
    assert abs(share_a - 2 / 3) <= 0.1 * (2 / 3)


def test_charge_replaces_the_estimate(redis_client):
    push(redis_client, "a0", tenant="A", cost=100)
    push(redis_client, "b0", tenant="B", cost=100)
    push(redis_client, "a1", tenant="A", cost=100)
    push(redis_client, "b1", tenant="B", cost=100)
    fq = FairQueue(redis_client, [BASE])
    first = fq.pick()
    assert first[1] == "a0"
    # a0 used 5 tokens instead of 100: A is owed service, so A goes again before B's second job.
    fq.charge(BASE, "A", 100, 5)
    assert picks(fq, 3) == ["b0", "a1", "b1"]
    assert redis_client.hget(tenant_tokens_key(BASE), "A") == b"5"


def test_empty_and_malformed_subqueues_are_skipped(redis_client):
    redis_client.hset(subqueue_index_key(BASE), "ghost", subqueue_meta(0, None))
    redis_client.hset(subqueue_index_key(BASE), f"{BASE}:bad", "{not json")
    redis_client.rpush(rq_queue_key(f"{BASE}:bad"), "x")
    push(redis_client, "ok")
    fq = FairQueue(redis_client, [BASE])
    assert picks(fq, 5) == ["ok"]
    assert not redis_client.hexists(subqueue_index_key(BASE), "ghost")


def test_model_queue_and_generic_queue_compete_fairly(redis_client):
    push(redis_client, "generic", priority=3)
    name = subqueue_name(BASE + "@m", 1)
    fields = {"status": "queued", JOB_FIELDS["enqueued"]: time.time(), JOB_FIELDS["cost"]: 10}
    redis_client.hset(rq_job_key("specific"), mapping=fields)
    redis_client.rpush(rq_queue_key(name), "specific")
    redis_client.hset(subqueue_index_key(BASE + "@m"), name, subqueue_meta(1, None))
    fq = FairQueue(redis_client, [BASE + "@m", BASE])
    assert picks(fq, 3) == ["specific", "generic"]

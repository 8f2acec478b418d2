"""Waiting queues pinned to exact orders: FCFS, priority with aging, fair (WFQ between tenants)."""

from __future__ import annotations

import pytest

from engine.fair import FairShare
from engine.request import Request
from engine.request_queue import FairQueue, FCFSQueue, PriorityQueue, aged_priority
from engine.sampling_params import SamplingParams


def req(rid, arrival, priority=0, tenant=None, prompt=4, max_tokens=4) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        rid, [9] * prompt, params, priority=priority, arrival_time=arrival, tenant=tenant
    )


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue) -> list[str]:
    out = []
    while len(queue):
        out.append(queue.pop().request_id)
    return out


def test_fcfs_preempted_go_to_the_front():
    q = FCFSQueue()
    for i, rid in enumerate("abc"):
        q.add(req(rid, i))
    q.readd_preempted(req("p", 9))
    assert drain(q) == ["p", "a", "b", "c"]


def test_priority_orders_by_priority_then_arrival():
    q = PriorityQueue(aging_seconds=None)
    q.add(req("low", 0, priority=5))
    q.add(req("mid", 1, priority=1))
    q.add(req("high", 2, priority=-1))
    q.add(req("mid2", 3, priority=1))
    assert ids(q) == ["high", "mid", "mid2", "low"]
    assert drain(q) == ["high", "mid", "mid2", "low"]


def test_priority_aging_improves_one_level_per_aging_seconds():
    old = req("old", 0.0, priority=9)
    assert aged_priority(old, 0.0, 10.0) == 9
    assert aged_priority(old, 25.0, 10.0) == 6.5
    assert aged_priority(old, 25.0, None) == 9
    q = PriorityQueue(aging_seconds=10.0)
    q.add(old)
    # Priority 0 arriving less than 9 * 10 s later passes it; later arrivals do not.
    q.add(req("early", 89.0, priority=0))
    q.add(req("late", 91.0, priority=0))
    assert drain(q) == ["early", "old", "late"]


def test_fair_queue_prefers_the_tenant_behind_its_share():
    fair = FairShare(starvation_seconds=None)
    q = FairQueue(fair, aging_seconds=None, clock=lambda: 100.0)
    for i in range(3):
        a = req(f"a{i}", i, tenant="A")
        fair.activate(a)
        q.add(a)
    b = req("b0", 10, tenant="B")
    fair.activate(b)
    q.add(b)
    # Equal virtual times: the virtual finish times tie, the earlier arrival goes first.
    assert q.peek().request_id == "a0"
    fair.charge(req("x", 0, tenant="A"), 8)
    # A is 8 tokens ahead: B's head (0 + 8) beats A's (8 + 8).
    assert ids(q) == ["b0", "a0", "a1", "a2"]
    assert q.peek().request_id == "b0"
    assert q.pop().request_id == "b0"


def test_fair_queue_weights_scale_the_virtual_time():
    fair = FairShare({"A": 2.0}, starvation_seconds=None)
    q = FairQueue(fair, aging_seconds=None, clock=lambda: 0.0)
    for r in (req("a", 0, tenant="A"), req("b", 1, tenant="B")):
        fair.activate(r)
        q.add(r)
    fair.charge(req("x", 0, tenant="A"), 10)  # A: 10 tokens / weight 2 = 5
    fair.charge(req("x", 0, tenant="B"), 4)  # B: 4
    # Relative to the system virtual time 4: A = 1 + 8/2 = 5, B = 0 + 8 = 8.
    assert fair.virtual_finish_time(q.peek()) == 5.0
    assert ids(q) == ["a", "b"]


def test_fair_queue_priority_band_comes_before_fairness():
    fair = FairShare(starvation_seconds=None)
    q = FairQueue(fair, aging_seconds=None, clock=lambda: 0.0)
    for r in (req("a", 0, tenant="A", priority=1), req("b", 1, tenant="B", priority=0)):
        fair.activate(r)
        q.add(r)
    fair.charge(req("x", 0, tenant="B"), 1000)
    assert ids(q) == ["b", "a"]


def test_starvation_boost_lowers_the_key_of_a_long_wait():
    fair = FairShare(starvation_seconds=60.0)
    now = [0.0]
    q = FairQueue(fair, aging_seconds=None, clock=lambda: now[0])
    long_one = req("long", 0.0, tenant="A", prompt=4, max_tokens=10)  # 14 tokens left
    short = req("short", 60.0, tenant="B", prompt=4, max_tokens=6)  # 10 tokens left
    for r in (long_one, short):
        fair.activate(r)
        q.add(r)
    now[0] = 30.0  # long waited 30 s: 14 * (1 - 0.3 * 0.5) = 11.9 > 10
    assert ids(q) == ["short", "long"]
    now[0] = 60.0  # 60 s: 14 * 0.7 = 9.8 < 10
    assert ids(q) == ["long", "short"]


def test_aged_low_priority_starts_within_the_stated_bound():
    # Stated bound (docs/SCHEDULING.md): a request of priority p is ahead of every request that
    # arrives (p - p_min + 1) * priority_aging_seconds or more after it, in any tenant.
    aging = 10.0
    now = [0.0]
    fair = FairShare(starvation_seconds=aging)
    q = FairQueue(fair, aging_seconds=aging, clock=lambda: now[0])
    old = req("old", 0.0, priority=9, tenant="bulk")
    fair.activate(old)
    q.add(old)
    fair.charge(req("x", 0, tenant="bulk"), 10_000)  # bulk is far ahead of its share
    bound = (9 - 0 + 1) * aging
    for t, tenant in ((bound, "web"), (bound, "bulk"), (bound + 5, "web")):
        r = req(f"{tenant}@{t}", t, priority=0, tenant=tenant)
        fair.activate(r)
        q.add(r)
    now[0] = bound + 5
    assert q.peek().request_id == "old"
    # Earlier (aged 9 - 7.5 = 1.5), a fresh priority-0 request of another tenant passes it.
    q2 = FairQueue(FairShare(starvation_seconds=aging), aging_seconds=aging, clock=lambda: 75.0)
    q2.add(req("old", 0.0, priority=9, tenant="bulk"))
    q2.add(req("web", 75.0, priority=0, tenant="web"))
    assert ids(q2) == ["web", "old"]


def test_fair_queue_remove_and_len():
    fair = FairShare()
    q = FairQueue(fair, clock=lambda: 0.0)
    a, b = req("a", 0, tenant="A"), req("b", 1, tenant="B")
    q.add(a)
    q.add(b)
    q.remove(a)
    assert len(q) == 1 and ids(q) == ["b"]
    assert q.pop() is b
    with pytest.raises(IndexError):
        q.peek()

"""Endings and dequeues gathered into fewer script calls (worker/coalesce.py), and nothing lost.

The policy classes are tested on their own; then a real worker with a long `--coalesce-window`:
its jobs end once each with fewer script calls than jobs, and endings still waiting when it is
stopped are written on the way out.
"""

from __future__ import annotations

import threading
import time

import pytest
from rq.registry import FinishedJobRegistry
from worker_helpers import make_client

from producer.contract.keys import result_key
from producer.contract.lua import LuaScript
from worker.coalesce import AdmissionGate, EndCoalescer, StreamWindow
from worker.rq_scripts import END

QUEUE = "q-coalesce"


def test_endings_wait_for_the_window_or_a_full_batch():
    c: EndCoalescer[str] = EndCoalescer(window_s=0.5, max_endings=3)
    assert c.hold("a", now=10.0)
    assert not c.due(now=10.2)
    assert c.wait_s(now=10.2) == pytest.approx(0.3)
    assert c.hold("b", now=10.3)
    assert c.due(now=10.5)  # the oldest waited the window
    assert c.take() == ["a", "b"]
    assert not c.due(now=99.0) and c.wait_s(now=99.0) is None
    for x in "xyz":
        c.hold(x, now=20.0)
    assert c.due(now=20.0)  # a full batch goes at once
    assert c.take() == ["x", "y", "z"]


def test_the_soonest_window_decides_when_all_are_written():
    c: EndCoalescer[str] = EndCoalescer(window_s=0.1)
    assert c.hold("bulk", now=0.0, window_s=1.0)
    assert not c.due(now=0.5)
    assert c.hold("online", now=0.5)  # due at 0.6, before the bulk one's 1.0
    assert not c.due(now=0.55) and c.due(now=0.6)
    assert c.take() == ["bulk", "online"]
    assert not c.hold("now", now=1.0, window_s=0)


def test_no_window_means_every_ending_is_written_at_once():
    c: EndCoalescer[str] = EndCoalescer(window_s=0)
    assert not c.hold("a", now=1.0)
    assert c.pending == [] and not c.due(now=1.0)


def test_streamed_tokens_wait_one_window_from_the_oldest_then_all_go_together():
    w = StreamWindow(interval_s=0.05)
    assert w.add("a", now=1.0, first=True)  # a first token: written at once
    assert not w.add("a", now=1.01, first=False)
    assert not w.add("b", now=1.03, first=False)
    assert not w.add("a", now=1.04, first=False)  # still one entry for "a"
    assert not w.due(now=1.059) and w.wait_s(now=1.03) == pytest.approx(0.03)
    assert w.due(now=1.06)  # one window after the oldest waiting token
    assert w.take() == ["a", "b"]
    assert not w.due(now=9.0) and w.wait_s(now=9.0) is None
    assert not w.add("c", now=2.0, first=False)
    w.discard("c")  # it ended: its tokens went with its end
    assert w.wait_s(now=2.0) is None
    assert StreamWindow(interval_s=0).add("d", now=3.0, first=False)  # 0: every step


def test_a_dequeue_waits_for_room_for_several_jobs_unless_the_engine_is_nearly_empty():
    gate = AdmissionGate(window_s=0.1, min_jobs=4)
    assert not gate.ready(room=0, in_flight=50, now=0.0)
    assert gate.ready(room=4, in_flight=50, now=0.0)  # room enough
    assert gate.ready(room=1, in_flight=2, now=0.0)  # nearly idle: at once
    assert not gate.ready(room=1, in_flight=50, now=1.0)  # one slot: wait a little
    assert not gate.ready(room=2, in_flight=50, now=1.05)
    assert gate.ready(room=2, in_flight=50, now=1.1)  # ... at most the window
    gate.dequeued()
    assert not gate.ready(room=1, in_flight=50, now=1.15)
    assert AdmissionGate(window_s=0).ready(room=1, in_flight=50, now=0.0)


@pytest.fixture(scope="module")
def client(private_redis):
    c = make_client(private_redis.url, QUEUE)
    yield c
    c.close()


def _jobs(n: int, tag: str) -> list[dict]:
    return [
        {"prompt": f"{tag} {i}: name a color", "temperature": 0.0, "ignore_eos": True,
         "max_tokens": 3 + i % 3}
        for i in range(n)
    ]  # fmt: skip


class ScriptCalls:
    """Counts the calls of one script (by its SHA1) that Redis runs, read with MONITOR: a
    worker's other calls (idle polls, heartbeats, reaps) grow with the run's wall time, which a
    loaded machine stretches."""

    def __init__(self, redis, script: LuaScript) -> None:
        self.sha = redis.script_load(script.source).encode()
        self.calls = 0
        self._monitor = redis.monitor()
        self._monitor.connection.send_command("MONITOR")  # started before the run, not lazily
        self._monitor.connection.read_response()
        threading.Thread(target=self._count, daemon=True).start()

    def _count(self) -> None:
        try:
            for cmd in self._monitor.listen():
                if cmd["command"].encode().lower().startswith(b"evalsha " + self.sha):
                    self.calls += 1
        except Exception:  # the connection closed at the end of the test
            pass


@pytest.mark.slow
def test_jobs_end_once_with_fewer_script_calls_than_jobs(worker_factory, client):
    worker = worker_factory(QUEUE, "w-coalesce", "--coalesce-window", "1.0")
    worker.wait_ready()
    n = 24
    ends = ScriptCalls(client.redis, END)
    job_ids = client.submit_many(_jobs(n, "a"))
    results = [client.result(j, timeout=120) for j in job_ids]
    assert [r.status for r in results] == ["finished"] * n
    assert all(client.redis.hget(f"rq:job:{j}", "status") == b"finished" for j in job_ids)
    assert FinishedJobRegistry(QUEUE, connection=client.redis).count == n
    # One by one, each job needs its own END call; gathered over 1 s, 24 jobs of 3 to 5 tokens
    # that run together end in a few.
    assert 1 <= ends.calls <= n // 4, f"{ends.calls} END calls for {n} jobs"
    worker.stop()


@pytest.mark.slow
def test_endings_still_waiting_are_written_when_the_worker_stops(worker_factory, client):
    worker = worker_factory(QUEUE, "w-coalesce-stop", "--coalesce-window", "30")
    worker.wait_ready()
    job_ids = client.submit_many(_jobs(4, "b"))
    deadline = time.monotonic() + 60
    while any(client.status(j) != "started" for j in job_ids):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.05)
    # Then done in the engine (in_flight falls to 0, in a status written since) while their
    # endings wait: a stop before would hand back the jobs the engine had not begun.
    started_at = time.time()
    while (s := worker.status() or {}).get("updated_at", 0) <= started_at or s["in_flight"]:
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.05)
    assert all(client.redis.exists(result_key(j)) == 0 for j in job_ids)
    assert worker.stop() == 0
    results = [client.result(j, timeout=10) for j in job_ids]
    assert [r.status for r in results] == ["finished"] * 4
    assert [client.redis.hget(f"rq:job:{j}", "status") for j in job_ids] == [b"finished"] * 4

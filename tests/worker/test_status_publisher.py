"""The worker status key against a real redis-server: fresh, rate-limited, safe when Redis dies."""

from __future__ import annotations

import json
import queue
import time
import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from engine.llm_engine import LLMEngine
from producer.client import Client
from producer.contract.keys import worker_key
from producer.status import queue_status
from worker.endpoints import WorkerHealth
from worker.engine_loop import AddRequest, EngineLoop, StepOutputs
from worker.redis_server import free_port
from worker.status import DEFAULT_INTERVAL_S, StatusPublisher, build_status

NAME = "w-status"


@dataclass
class Stats:
    """The EngineStats fields the status reads."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 64
    num_free_blocks: int = 64
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_steps: int = 0
    num_generated_tokens: int = 0


CONFIG = {"model": "tiny", "queue": "q-status"}


@pytest.fixture
def redis_conn(private_redis):
    private_redis.start()  # a no-op unless a test killed it
    conn = private_redis.client()
    conn.flushall()
    yield conn
    conn.close()


def make_publisher(conn, stats: Stats, in_flight: list[int], **kwargs) -> StatusPublisher:
    return StatusPublisher(conn, NAME, CONFIG, lambda: stats, lambda: in_flight[0], **kwargs)


def read(conn) -> dict:
    return json.loads(conn.get(worker_key(NAME)))


def test_one_set_with_an_expiry_and_every_field(redis_conn):
    stats = Stats(num_running=3, num_waiting=2, kv_cache_usage=0.125, num_free_blocks=56)
    publisher = make_publisher(redis_conn, stats, [5], ttl_s=7)
    before = time.time()
    assert publisher.maybe_publish(now=100.0)
    status = read(redis_conn)
    assert before <= status.pop("updated_at") <= time.time()
    expected = build_status(stats, 5, CONFIG)
    del expected["updated_at"]
    assert status == expected
    assert (status["in_flight"], status["running"], status["waiting"]) == (5, 3, 2)
    assert (status["kv_cache_usage"], status["num_free_blocks"]) == (0.125, 56)
    assert (status["model"], status["queue"], status["config"]) == ("tiny", "q-status", CONFIG)
    assert 0 < redis_conn.ttl(worker_key(NAME)) <= 7


def test_at_most_once_per_interval_but_at_once_when_the_worker_empties(redis_conn):
    stats, in_flight = Stats(num_running=2, kv_cache_usage=0.5), [2]
    publisher = make_publisher(redis_conn, stats, in_flight, interval_s=0.5)
    assert publisher.maybe_publish(now=10.0)
    stats.num_running = 1
    assert not publisher.maybe_publish(now=10.2)  # within the interval: no write
    assert read(redis_conn)["running"] == 2
    assert publisher.maybe_publish(now=10.5)
    assert read(redis_conn)["running"] == 1

    in_flight[0] = 0  # the last job ended (or every job was canceled)
    assert publisher.maybe_publish(now=10.6)  # written at once, not at 11.0
    assert read(redis_conn)["in_flight"] == 0
    stats.num_running, stats.kv_cache_usage = 0, 0.0  # the engine applied the abort
    assert publisher.maybe_publish(now=10.65)
    assert read(redis_conn)["running"] == 0 and read(redis_conn)["kv_cache_usage"] == 0.0
    assert not publisher.maybe_publish(now=10.7)  # nothing fell to zero: the interval again
    assert publisher.num_published == 4  # at 10.0, 10.5, 10.6 and 10.65


def test_a_dead_redis_is_reported_to_health_not_raised(private_redis, redis_conn):
    clock = [1000.0]
    health = WorkerHealth("tiny", lambda: True, redis_grace_s=30, clock=lambda: clock[0])
    publisher = make_publisher(redis_conn, Stats(), [0], health=health)
    assert publisher.maybe_publish(now=1.0)
    private_redis.kill()
    try:
        assert not publisher.maybe_publish(now=1.0 + publisher.interval_s)
        report = health.report()
        assert report["redis_connected"] is False and report["status"] == "ok"
        assert "Error" in report["redis_error"]
        clock[0] += 31
        assert not publisher.maybe_publish(now=1.0 + 2 * publisher.interval_s)
        assert health.report()["status"] == "unhealthy"
    finally:
        private_redis.start()
    assert publisher.maybe_publish(now=1.0 + 3 * publisher.interval_s)
    assert health.report()["status"] == "ok"
    assert read(redis_conn)["in_flight"] == 0


def test_pagedq_status_sees_the_engine_empty_within_a_second(
    private_redis, redis_conn, tiny_llama_dir
):
    """A control loop as the worker runs it: engine thread, events, maybe_publish each turn."""
    engine = LLMEngine(model=tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory="16MiB")
    loop = EngineLoop(engine)
    loop.wait_for_admission = False
    in_flight: set[str] = set()
    publisher = StatusPublisher(
        redis_conn, NAME, CONFIG, lambda: loop.stats, lambda: len(in_flight), interval_s=0.5
    )
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for i in range(6):
            in_flight.add(f"r{i}")
            loop.add(AddRequest(f"r{i}", list(range(50 + i, 80 + i)), params))
        deadline = time.monotonic() + 120
        while in_flight and time.monotonic() < deadline:
            try:
                event = loop.events.get(timeout=0.02)
            except queue.Empty:
                event = None
            if isinstance(event, StepOutputs):
                in_flight -= {o.request_id for o in event.outputs if o.finished}
            publisher.maybe_publish()
        ended_at = time.time()
        assert not in_flight

        # What `pagedq status` shows right after the last job ended, with no heartbeat between.
        client = Client(private_redis.url, queue="q-status")
        (worker,) = queue_status(client)["workers"]
        client.close()
        assert worker["in_flight"] == 0
        assert worker["running"] == 0 and worker["waiting"] == 0
        assert worker["kv_cache_usage"] == 0.0
        assert abs(worker["updated_at"] - ended_at) < 1.0
    finally:
        loop.stop()


# --- a real worker process --------------------------------------------------------------------


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@pytest.mark.slow
def test_a_worker_shows_zero_one_second_after_its_last_job(private_redis, worker_factory):
    port = free_port()
    worker = worker_factory("q-fresh", "w-fresh", "--metrics-port", str(port))
    worker.wait_ready()
    client = Client(private_redis.url, queue="q-fresh", check_interval=0.5)
    job_ids = client.submit_many({"prompt": f"Count to {i}", "max_tokens": 8} for i in range(8))
    for job_id in job_ids:
        client.result(job_id, timeout=240)
    time.sleep(1.0)
    m = _scrape(port)
    assert m["pagedq:num_requests_running"] == 0
    assert m["pagedq:num_requests_waiting"] == 0
    assert m["pagedq:kv_cache_usage_perc"] == 0
    assert m["pagedq:jobs_in_flight"] == 0
    ended = m["pagedq:request_success_total{finished_reason=length}"]
    assert ended + m["pagedq:request_success_total{finished_reason=stop}"] == 8
    assert m["pagedq:time_to_first_token_seconds_count"] == 8
    status = worker.status()
    assert status["in_flight"] == 0 and status["running"] == 0
    # Rewritten when in_flight fell to 0, then every interval while the worker is idle.
    assert time.time() - status["updated_at"] < DEFAULT_INTERVAL_S + 1.0

    # Cancel a long backlog: `pagedq status` says 0 in flight within a second.
    long_ids = client.submit_many(
        {"prompt": f"Write a story {i}", "max_tokens": 400, "ignore_eos": True} for i in range(12)
    )
    deadline = time.monotonic() + 60
    while worker.status()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    for job_id in long_ids:
        client.cancel(job_id)
    canceled_at = time.monotonic()
    while worker.status()["in_flight"] != 0 and time.monotonic() < canceled_at + 10:
        time.sleep(0.05)
    assert worker.status()["in_flight"] == 0
    assert time.monotonic() - canceled_at < 1.0
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read())
    assert health["status"] == "ok" and health["engine_alive"] and health["redis_connected"]
    client.close()

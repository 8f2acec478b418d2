"""The producer reads what jobs left in Redis as JSON only: crafted pickles never run."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest
from rq.job import Job
from rq.results import Result

from producer.cli import main as pagedq
from producer.client import Client
from producer.contract.keys import GENERATE_FUNC, result_key, stream_key
from producer.errors import JobFailedError


class Marker:
    """Unpickling this creates the marker file (as any code of an attacker's choice could)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def craft_job(redis, job_id: str, status: str, marker: Path, queue: str = "pagedq") -> None:
    """A job hash whose every deserializable field is a pickle, and an RQ result entry too."""
    evil = pickle.dumps(Marker(marker))
    redis.hset(
        Job.key_for(job_id),
        mapping={
            "data": zlib.compress(evil),
            "meta": evil,
            "result": evil,
            "exc_info": zlib.compress(b"Traceback\nValueError: boom"),
            "origin": queue,
            "status": status,
            "created_at": "2025-01-31T12:00:00Z",
            "enqueued_at": "2025-01-31T12:00:00Z",
            "custom_id": "x",
        },
    )
    redis.xadd(
        Result.get_key(job_id),
        {
            "type": "1" if status == "finished" else "2",
            "return_value": base64.b64encode(evil),
            "exc_string": base64.b64encode(zlib.compress(b"Traceback\nValueError: boom")),
        },
    )


@pytest.fixture
def client(redis_client):
    with Client(connection=redis_client, check_interval=0.2) as c:
        yield c


@pytest.mark.parametrize("status", ["finished", "failed", "canceled", "queued"])
def test_crafted_pickles_are_never_unpickled(client, redis_client, tmp_path, status):
    marker = tmp_path / "pwned"
    craft_job(redis_client, "evil", status, marker)
    if status == "queued":
        redis_client.rpush("rq:queue:pagedq", "evil")
    client.status("evil")
    client.cancel("evil")  # a queued job is canceled through RQ, its payload read as JSON
    try:
        client.result("evil", timeout=2)
    except (JobFailedError, TimeoutError, RuntimeError):
        pass
    url = redis_client.connection_pool.connection_kwargs
    redis_url = f"redis://{url['host']}:{url['port']}/0"
    assert pagedq(["result", "evil", "--timeout", "2", "--redis-url", redis_url]) in (0, 1)
    assert pagedq(["cancel", "evil", "--redis-url", redis_url]) == 0
    assert not marker.exists()


def test_resubmitting_over_a_crafted_failed_job_deletes_it_without_unpickling(
    client, redis_client, tmp_path
):
    marker = tmp_path / "pwned"
    job_id = client.submit(prompt="hi", custom_id="again")
    redis_client.delete(Job.key_for(job_id))
    redis_client.lrem("rq:queue:pagedq", 0, job_id)
    craft_job(redis_client, job_id, "failed", marker)
    assert client.submit(prompt="hi", custom_id="again") == job_id
    assert not marker.exists()
    data = json.loads(zlib.decompress(redis_client.hget(Job.key_for(job_id), "data")))
    assert data[0] == GENERATE_FUNC and data[2][0]["prompt"] == "hi"
    assert redis_client.hget(Job.key_for(job_id), "meta") is None


def test_failed_job_message_and_rq_return_value_are_read_as_json(client, redis_client):
    redis_client.hset(Job.key_for("f1"), mapping={"origin": "pagedq", "status": "failed"})
    redis_client.xadd(
        Result.get_key("f1"),
        {"type": "2", "exc_string": base64.b64encode(zlib.compress(b"Tb\nValueError: boom"))},
    )
    with pytest.raises(JobFailedError, match="ValueError: boom"):
        client.result("f1", timeout=5)
    value = {"job_id": "f2", "status": "finished", "text": "ok"}
    redis_client.hset(Job.key_for("f2"), mapping={"origin": "pagedq", "status": "finished"})
    redis_client.xadd(
        Result.get_key("f2"),
        {"type": "1", "return_value": base64.b64encode(json.dumps(value).encode())},
    )
    redis_client.xadd(stream_key("f2"), {"event": "done"})
    assert client.result("f2", timeout=5).text == "ok"


def test_a_result_key_that_is_not_json_reads_as_a_failure(client, redis_client):
    redis_client.set(result_key("g"), pickle.dumps({"x": 1}))
    with pytest.raises(JobFailedError, match="unreadable result"):
        client.result("g", timeout=1)

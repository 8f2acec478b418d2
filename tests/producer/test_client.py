"""Client against a real redis-server: exactly the right RQ jobs in, results and streams out."""

from __future__ import annotations

import json
import threading
import time
import zlib

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.registry import CanceledJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.client import Client
from producer.contract.ids import job_id_for
from producer.contract.keys import CANCEL_CHANNEL, GENERATE_FUNC, cancel_key, result_key, stream_key
from producer.contract.schema import GenerationRequest
from producer.errors import InvalidRequestError, JobCanceledError, JobFailedError, JobNotFoundError
from producer.results import decode_entry


@pytest.fixture
def client(redis_server, redis_client):
    with Client(redis_server.url, check_interval=0.2) as c:
        yield c


def fetch(client: Client, job_id: str) -> Job:
    return Job.fetch(job_id, connection=client.redis, serializer=JSONSerializer)


def test_submit_enqueues_one_json_rq_job_naming_the_generate_function(client):
    job_id = client.submit(prompt="hi", max_tokens=5, temperature=0)
    job = fetch(client, job_id)
    assert job.func_name == GENERATE_FUNC
    assert job.args == [
        GenerationRequest.parse(
            {"prompt": "hi", "max_tokens": 5, "temperature": 0, "stream": True}
        ).payload()
    ]
    assert job.kwargs == {}
    assert job.get_status() == "queued" and job.origin == "pagedq"
    assert (job.retries_left, job.result_ttl, job.timeout) == (3, 7 * 24 * 3600, 3600)
    assert client.queue.job_ids == [job_id]
    assert client.redis.smembers("rq:queues") == {b"rq:queue:pagedq"}
    # What RQ stores is zlib-compressed JSON, never a pickle.
    data = json.loads(zlib.decompress(client.redis.hget(job.key, "data")))
    assert data == [GENERATE_FUNC, None, job.args, {}]
    assert client.status(job_id) == "queued"


def test_submit_refuses_bad_fields_and_enqueues_nothing(client):
    with pytest.raises(InvalidRequestError, match="max_tokens: must be >= 1, got 0"):
        client.submit(prompt="hi", max_tokens=0)
    with pytest.raises(InvalidRequestError, match="bogus: unknown field"):
        client.submit(prompt="hi", bogus=1)
    assert client.queue.count == 0


def test_submit_with_custom_id_is_idempotent_for_the_same_request_only(client):
    first = client.submit(prompt="hi", custom_id="row-1")
    again = client.submit(prompt="hi", custom_id="row-1", max_tokens=256)  # the default
    assert first == again == job_id_for("row-1", "pagedq", fetch(client, first).args[0])
    edited = client.submit(prompt="something else", custom_id="row-1")
    assert edited != first
    assert client.queue.job_ids == [first, edited]
    assert fetch(client, first).args[0]["prompt"] == "hi"
    assert fetch(client, edited).args[0]["prompt"] == "something else"


def test_custom_id_of_a_finished_job_is_reused_even_after_rq_forgot_it(served):
    with served.client() as client:
        job_id = client.submit(prompt="hi", custom_id="done-1", max_tokens=3, ignore_eos=True)
        text = client.result(job_id, timeout=30).text
        served.redis.delete(Job.key_for(job_id))  # RQ's hash expired, our result key did not
        again = client.submit(prompt="hi", custom_id="done-1", max_tokens=3, ignore_eos=True)
        assert again == job_id
        assert not served.redis.exists(Job.key_for(job_id))  # nothing was enqueued again
        assert client.status(job_id) == "finished"
        assert client.result(job_id).text == text


def test_custom_id_of_a_canceled_job_runs_again(client):
    job_id = client.submit(prompt="hi", custom_id="retry-me")
    assert client.cancel(job_id)
    assert client.submit(prompt="hi", custom_id="retry-me") == job_id
    assert client.status(job_id) == "queued"
    assert client.queue.job_ids == [job_id]
    assert not client.redis.exists(result_key(job_id), stream_key(job_id), cancel_key(job_id))


def test_custom_id_of_a_failed_job_runs_again(served):
    with served.client() as client:
        # Longer than the model's context: the worker fails it (a job naming another model
        # would wait in that model's queue instead).
        job_id = client.submit(prompt=[100] * 100_000, custom_id="retry-me")
        with pytest.raises(JobFailedError, match="invalid request"):
            client.result(job_id, timeout=30)
        assert client.status(job_id) == "failed"
        # The same request again: the same job, run afresh (the old run's records deleted).
        assert client.submit(prompt=[100] * 100_000, custom_id="retry-me") == job_id
        with pytest.raises(JobFailedError, match="invalid request"):
            client.result(job_id, timeout=30)
        assert served.executions(job_id) == 1
        # The corrected request is a new job under the same custom_id.
        fixed = client.submit(prompt="hi", custom_id="retry-me", max_tokens=3, ignore_eos=True)
        assert fixed != job_id
        deltas = list(client.stream(fixed, timeout=30))
        result = client.result(fixed)
        assert (result.status, result.usage.completion_tokens) == ("finished", 3)
        assert "".join(deltas) == result.text
        assert served.executions(fixed) == 1


def test_submit_many_enqueues_all_in_order_with_duplicates_collapsed(client):
    requests = [{"prompt": f"p{i}", "custom_id": f"c{i}"} for i in range(25)]
    requests.append(GenerationRequest.parse({"prompt": "typed"}))
    requests.append({"prompt": "p3", "custom_id": "c3"})  # the same request again
    job_ids = client.submit_many(requests, chunk_size=10)
    assert len(job_ids) == 27 and job_ids[26] == job_ids[3]
    assert client.queue.job_ids == job_ids[:26]
    assert [j.args[0]["prompt"] for j in client.queue.jobs][:3] == ["p0", "p1", "p2"]


def test_submit_many_validates_a_chunk_before_enqueuing_it(client):
    requests = [{"prompt": "ok"}, {"prompt": "bad", "top_p": 0}]
    with pytest.raises(InvalidRequestError, match="top_p"):
        client.submit_many(requests)
    assert client.queue.count == 0


def test_cancel_of_a_queued_job_removes_it_and_ends_it_canceled(client):
    pubsub = client.redis.pubsub()
    pubsub.subscribe(CANCEL_CHANNEL)
    pubsub.get_message(timeout=1)
    keep = client.submit(prompt="keep")
    job_id = client.submit(prompt="drop", custom_id="drop", metadata={"k": 1})
    assert client.cancel(job_id) is True
    assert pubsub.get_message(timeout=1)["data"] == job_id.encode()
    assert client.redis.get(cancel_key(job_id)) == b"1"
    assert client.queue.job_ids == [keep]
    assert client.queue.canceled_job_registry.get_job_ids() == [job_id]
    assert client.status(job_id) == "canceled"
    with pytest.raises(JobCanceledError) as err:
        client.result(job_id, timeout=2)
    assert err.value.result.metadata == {"k": 1} and err.value.result.custom_id == "drop"
    assert client.cancel(job_id) is False  # already ended


def test_cancel_of_a_running_job_is_left_to_its_worker(served):
    with served.client() as client:
        job_id = client.submit(prompt="hi", max_tokens=480, ignore_eos=True)
        deadline = time.monotonic() + 30
        while not served.redis.xlen(stream_key(job_id)):  # the worker generates its tokens
            assert time.monotonic() < deadline, served.worker.log_tail()
            time.sleep(0.01)
        assert client.status(job_id) == "started"
        assert client.cancel(job_id) is True
        assert client.redis.get(cancel_key(job_id)) == b"1"
        with pytest.raises(JobCanceledError) as err:
            client.result(job_id, timeout=30)
    # The worker aborted it and wrote its end (the producer writes only a queued job's end).
    result = err.value.result
    assert (result.status, result.worker, result.model) == (
        "canceled",
        served.worker.name,
        served.model,
    )
    assert 0 < result.usage.completion_tokens < 480
    assert served.fetch(job_id).get_status() == "canceled"
    assert job_id in CanceledJobRegistry(served.queue, connection=served.redis)
    (_, last), *_ = served.redis.xrevrange(stream_key(job_id), count=1)
    assert last == {b"event": b"error", b"error": b"canceled"}


def test_cancel_and_status_of_unknown_job(client):
    assert client.cancel("no-such-job") is False
    assert client.status("no-such-job") == "unknown"


def stream_entries(r: Redis, job_id: str) -> list[dict[str, str]]:
    return [decode_entry(fields) for _, fields in r.xrange(stream_key(job_id))]


def test_result_blocks_until_the_worker_writes_it(served):
    got: dict = {}
    with served.client() as client:
        with served.worker.paused():  # a stopped worker cannot end the job
            job_id = client.submit(prompt="hi", custom_id="r1", max_tokens=5, ignore_eos=True)

            def wait() -> None:
                got["result"] = client.result(job_id, timeout=30)
                got["at"] = time.monotonic()

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(0.3)
            resumed_at = time.monotonic()
            assert thread.is_alive()
        thread.join(30)
        result = got["result"]
        assert got["at"] > resumed_at  # it returned only once the worker had run the job
        assert (result.status, result.custom_id, result.finish_reason) == (
            "finished",
            "r1",
            "length",
        )
        assert len(result.token_ids) == result.usage.completion_tokens == 5
        assert (result.worker, result.model) == (served.worker.name, served.model)
        tokens = stream_entries(served.redis, job_id)[:-1]
        assert "".join(e["delta"] for e in tokens) == result.text
        assert sum((json.loads(e["token_ids"]) for e in tokens), []) == result.token_ids
        assert client.result(job_id).text == result.text  # already there: returns at once


def test_stream_yields_deltas_in_order_then_ends(served):
    with served.client() as client:
        job_id = client.submit(prompt="The capital", max_tokens=12, ignore_eos=True)
        deltas = list(client.stream(job_id, timeout=30))
        *tokens, final = stream_entries(served.redis, job_id)
        assert final == {"event": "done", "finish_reason": "length"}
        assert deltas == [e["delta"] for e in tokens if e["delta"]]
        assert len(tokens) > 1  # one entry per engine step, not one at the end
        assert "".join(deltas) == client.result(job_id).text


def test_a_window_carries_several_tokens_in_one_entry_and_the_first_token_goes_at_once(served):
    with served.client() as client:
        job_id = client.submit(prompt="Once upon", max_tokens=40, ignore_eos=True)
        deltas = list(client.stream(job_id, timeout=60))
        result = client.result(job_id)
        *tokens, final = stream_entries(served.redis, job_id)
        assert final == {"event": "done", "finish_reason": "length"}
        ids = [json.loads(e["token_ids"]) for e in tokens]
        assert len(ids[0]) == 1  # the first token did not wait for a window
        assert len(tokens) < len(result.token_ids) == 40  # later ones shared entries
        assert max(len(i) for i in ids) > 1
        assert sum(ids, []) == result.token_ids
        assert "".join(deltas) == "".join(e["delta"] for e in tokens) == result.text


def test_stream_of_a_job_whose_stream_expired_yields_the_whole_text(served):
    with served.client() as client:
        job_id = client.submit(prompt="hi", max_tokens=4, ignore_eos=True)
        text = client.result(job_id, timeout=30).text
        served.redis.delete(stream_key(job_id))  # as its TTL would
        assert list(client.stream(job_id, timeout=5)) == [text]


def test_result_of_a_failed_job_raises_with_its_error(served):
    with served.client() as client:
        job_id = client.submit(prompt="word " * 600, max_tokens=4)  # longer than max_model_len
        with pytest.raises(JobFailedError, match="must be shorter than max_model_len") as err:
            client.result(job_id, timeout=30)
        assert err.value.error.startswith(
            "invalid request: prompt: must be shorter than max_model_len"
        )
        assert err.value.result.worker == served.worker.name
        with pytest.raises(JobFailedError, match="max_model_len"):
            list(client.stream(job_id, timeout=5))
        assert served.fetch(job_id).get_status() == "failed"


def test_result_of_a_job_rq_failed_without_a_pagedq_entry_carries_rq_error(client):
    job_id = client.submit(prompt="hi")
    job = fetch(client, job_id)
    client.redis.lpop(client.queue.key)
    Result.create_failure(job, ttl=60, exc_string="Traceback...\nRuntimeError: worker died")
    client.redis.hset(job.key, "status", "failed")
    with pytest.raises(JobFailedError) as err:
        client.result(job_id, timeout=5)
    assert err.value.error == "RuntimeError: worker died"


def test_result_times_out_and_unknown_job_is_not_found(client):
    job_id = client.submit(prompt="hi")
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        client.result(job_id, timeout=0.3)
    assert time.monotonic() - start < 1.0
    with pytest.raises(JobNotFoundError):
        client.result("never-submitted", timeout=5)


def test_client_works_with_another_queue_name(redis_server, redis_client):
    with Client(redis_server.url, queue="other") as c:
        job_id = c.submit(prompt="hi", custom_id="x")
        assert job_id == job_id_for("x", "other", GenerationRequest(prompt="hi").payload())
        assert Queue("other", connection=c.redis).job_ids == [job_id]


def test_client_reconnects_after_redis_restarts(client, redis_server):
    first = client.submit(prompt="before", max_tokens=4)
    redis_server.restart()  # a crash without persistence: the queue is empty afterwards
    assert client.status(first) == "unknown"
    second = client.submit(prompt="after", max_tokens=4)
    assert Queue("pagedq", connection=client.redis, serializer=JSONSerializer).job_ids == [second]


def test_bulk_jobs_write_no_stream_and_streamed_ones_their_tokens(served):
    with served.client() as client:
        fields = {"prompt": "hi", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        (bulk,) = client.submit_many([fields])
        streamed = client.submit(**fields)
        text = client.result(bulk, timeout=30).text
        assert client.result(streamed, timeout=30).text == text
        assert stream_entries(served.redis, bulk) == []  # no stream: its result is read
        assert stream_entries(served.redis, streamed)[-1] == {
            "event": "done",
            "finish_reason": "length",
        }
        tokens = [e for e in stream_entries(served.redis, streamed) if e["event"] == "token"]
        assert sum(len(json.loads(e["token_ids"])) for e in tokens) == 6
        assert list(client.stream(bulk, timeout=5)) == [text]

"""What RQ's own tooling sees after each rq_adapter script (real redis-server, no model).

These pin the contract with RQ 3.0: `Job.fetch(..., serializer=JSONSerializer)`, `get_status()`,
`latest_result()`, the registries and `Worker.all` read what the Lua scripts write, and no
callback or webhook a job hash names is ever called.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from rq import Worker
from rq.job import Job
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.client import Client
from producer.contract.codec import load_job_data
from producer.contract.keys import EXECUTION_PREFIX_CHARS, WAKE_RETAIN_MS, WAKE_TTL_S, fence_key
from producer.contract.models import canonical_model
from producer.contract.routing import model_queue
from producer.contract.stream import (
    DELTAS_WAKE,
    ENTRIES_FIELD,
    INLINE_WAKE,
    decode_inline,
    inline_entries,
    inline_job_ids,
)
from worker.claim import Claim
from worker.redis_link import ScriptRunner
from worker.rq_adapter import RQAdapter
from worker.rq_scripts import STEP

QUEUE = "q-adapter"
MARKER_DIR_ENV = "PAGEDQ_TEST_MARKER_DIR"


def marker_callback(*args, **kwargs) -> None:
    """What a malicious job names as its callback: it would leave a file if ever called."""
    import os

    Path(os.environ[MARKER_DIR_ENV], "called").write_text("called")


class Driver:
    """An RQAdapter whose calls run at once, as the control loop runs them."""

    def __init__(self, adapter: RQAdapter) -> None:
        self.adapter = adapter
        self.scripts = ScriptRunner(adapter.connection)

    def __getattr__(self, name: str):
        return getattr(self.adapter, name)

    def register(self) -> bool:
        return bool(self.scripts.call(self.adapter.register_call()))

    def dequeue(self) -> Claim | None:
        claims = self.dequeue_many(1)
        return claims[0] if claims else None

    def dequeue_many(self, max_jobs: int, ahead: int = 0) -> list[Claim]:
        call, started_at = self.adapter.dequeue_call(max_jobs, ahead)
        return self.adapter.claims(self.scripts.call(call), started_at)

    def stream(self, step) -> list[str]:
        """Run a STREAM call; the job ids whose entries were refused."""
        return self.adapter.stream_lost(self.scripts.call(self.adapter.stream_call(step)))

    def reap(self) -> tuple[list[str], list[str]]:
        requeued, failed = self.scripts.call(self.adapter.reap_call())
        return [j.decode() for j in requeued], [j.decode() for j in failed]

    def end_call(self, claim, status, result: dict, final, summary=None, **kwargs):
        usage = result.get("usage") or {}
        used = (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        return self.adapter.end_call(
            claim, status, json.dumps(result), used, final, summary,
            error=result.get("error"), **kwargs,
        )  # fmt: skip

    def requeue_call(self, claim, *, count_crash: bool, result: dict, reason: str):
        failed = json.dumps({**result, "status": "failed", "error": reason})
        return self.adapter.requeue_call(
            claim, count_crash=count_crash, result_json=failed, reason=reason
        )


def _adapter(
    redis_client,
    *,
    lease_ttl: int = 30,
    max_crashes: int = 2,
    name: str = "w1",
    rq_results: str = "all",
):
    return Driver(
        RQAdapter(
            redis_client,
            name,
            [model_queue(QUEUE, "smollm2"), QUEUE],
            lease_ttl=lease_ttl,
            result_ttl=600,
            stream_ttl=600,
            max_crashes=max_crashes,
            rq_results=rq_results,
        )
    )


def _fetch(redis_client, job_id: str) -> Job:
    return Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer)


def _registries(redis_client, queue: str = QUEUE) -> dict[str, list[str]]:
    kw = dict(connection=redis_client, serializer=JSONSerializer)
    return {
        "started": StartedJobRegistry(queue, **kw).get_job_ids(cleanup=False),
        "finished": FinishedJobRegistry(queue, **kw).get_job_ids(cleanup=False),
        "failed": FailedJobRegistry(queue, **kw).get_job_ids(cleanup=False),
        "canceled": CanceledJobRegistry(queue, **kw).get_job_ids(cleanup=False),
    }


def _result(status: str, job_id: str, **extra) -> dict:
    return {"job_id": job_id, "status": status, "text": "hi", "token_ids": [1], **extra}


def test_dequeue_marks_the_job_started_in_one_step_and_rq_sees_it(redis_client):
    job_id = Client(connection=redis_client, queue=QUEUE).submit(prompt="hi", max_tokens=4)
    claim = _adapter(redis_client).dequeue()

    assert claim.job_id == job_id and claim.queue == QUEUE and claim.attempt == 1
    assert load_job_data(claim.data, 2**20)[2][0]["prompt"] == "hi"
    assert redis_client.llen(f"rq:queue:{QUEUE}") == 0
    job = _fetch(redis_client, job_id)
    assert job.get_status() == "started" and job.worker_name == "w1"
    assert _registries(redis_client)["started"] == [job_id]
    assert _adapter(redis_client).dequeue() is None


def test_finish_writes_rq_state_the_result_key_and_the_final_entry_in_one_script(redis_client):
    job_id = Client(connection=redis_client, queue=QUEUE).submit(prompt="hi", max_tokens=4)
    adapter = _adapter(redis_client)
    claim = adapter.dequeue()
    summary = {"job_id": job_id, "status": "finished", "result_key": f"pagedq:result:{job_id}"}
    done = {"event": "done"}
    end = adapter.end_call(claim, "finished", _result("finished", job_id), done, summary)

    assert adapter.scripts.call(end) == [1]
    job = _fetch(redis_client, job_id)
    assert job.get_status() == "finished" and job.ended_at is not None
    latest = job.latest_result()
    assert latest.type == Result.Type.SUCCESSFUL and latest.return_value == summary
    assert _registries(redis_client) == {
        "started": [], "finished": [job_id], "failed": [], "canceled": []
    }  # fmt: skip
    assert json.loads(redis_client.get(f"pagedq:result:{job_id}"))["text"] == "hi"
    entries = redis_client.xrange(f"pagedq:stream:{job_id}")
    assert [e[1] for e in entries] == [{b"event": b"done"}]
    # The same ending sent again (its first reply lost with a cut connection) writes nothing
    # twice, and tells the worker that it ended the job (2), so that it logs and counts the end.
    assert adapter.scripts.call(end) == [2]
    assert len(job.results()) == 1 and redis_client.xlen(f"pagedq:stream:{job_id}") == 1
    # Another status from the same execution is not its ending: refused.
    failed = adapter.end_call(claim, "failed", _result("failed", job_id, error="x"), done)
    assert adapter.scripts.call(failed) == [0]
    assert _fetch(redis_client, job_id).get_status() == "finished"


def test_a_staged_result_becomes_the_result_key_only_through_the_end_that_holds_the_job(
    redis_client,
):
    """`stage_result` SETs the result beside END, which renames it to the result key (TTL
    kept) when its execution holds the job; a repeated END, a lost lease and a staged result
    that is gone (evicted) leave no staged key and write no result."""
    client = Client(connection=redis_client, queue=QUEUE)
    a, b, c = (client.submit(prompt=p) for p in ("a", "b", "c"))
    adapter = _adapter(redis_client)
    claims = {claim.job_id: claim for claim in adapter.dequeue_many(3)}

    def staged(job_id: str) -> list:
        result = _result("finished", job_id)
        return [
            adapter.stage_result(claims[job_id], json.dumps(result)),
            adapter.end_call(claims[job_id], "finished", result, {}, staged=True),
        ]

    assert adapter.scripts.run(staged(a)) == [True, [1]]
    assert json.loads(redis_client.get(f"pagedq:result:{a}"))["job_id"] == a
    assert 590 <= redis_client.ttl(f"pagedq:result:{a}") <= 600
    assert _fetch(redis_client, a).get_status() == "finished"
    assert redis_client.keys("pagedq:staged:*") == []
    # Sent again (its reply lost): ended once already, its second staged copy dropped.
    assert adapter.scripts.run(staged(a)) == [True, [2]]
    assert redis_client.keys("pagedq:staged:*") == []

    # A lease a reaper took: no result, no staged key left.
    redis_client.zadd(f"rq:wip:{claims[b].queue}", {claims[b].member: 0}, xx=True)
    assert _adapter(redis_client, name="w2").reap() == ([b], [])
    assert adapter.scripts.run(staged(b)) == [True, [0]]
    assert redis_client.exists(f"pagedq:result:{b}") == 0
    assert redis_client.keys("pagedq:staged:*") == []

    # The staged result gone before its END ran (evicted): the job is not ended (its lease
    # runs out and it runs again), nothing of its end is written.
    [stage, end] = staged(c)
    assert adapter.scripts.call(end) == [0]
    assert _fetch(redis_client, c).get_status() == "started"
    assert redis_client.exists(f"pagedq:result:{c}") == 0
    assert _registries(redis_client)["finished"] == [a]


def test_fail_and_cancel_land_in_rqs_failed_and_canceled_registries(redis_client):
    client = Client(connection=redis_client, queue=QUEUE)
    bad, gone = client.submit(prompt="a"), client.submit(prompt="b")
    adapter = _adapter(redis_client)
    claims = {c.job_id: c for c in (adapter.dequeue(), adapter.dequeue())}
    error = {"event": "error", "error": "max_tokens: bad"}
    fail = adapter.end_call(claims[bad], "failed", _result("failed", bad, error="x"), error)
    cancel_final = {"event": "error", "error": "canceled"}
    cancel = adapter.end_call(claims[gone], "canceled", _result("canceled", gone), cancel_final)

    assert adapter.scripts.run([fail, cancel]) == [[1], [1]]
    assert _fetch(redis_client, bad).latest_result().exc_string == "x"
    assert _fetch(redis_client, gone).get_status() == "canceled"
    assert _registries(redis_client) == {
        "started": [], "finished": [], "failed": [bad], "canceled": [gone]
    }  # fmt: skip


def test_expired_leases_are_requeued_then_failed_after_max_crashes(redis_client):
    job_id = Client(connection=redis_client, queue=QUEUE).submit(prompt="hi")
    dead = _adapter(redis_client, lease_ttl=1, name="dead")
    reaper = _adapter(redis_client, lease_ttl=1, name="reaper")
    first = dead.dequeue()
    time.sleep(1.1)
    assert reaper.reap() == ([job_id], [])
    assert _fetch(redis_client, job_id).get_status() == "queued"
    # The dead worker wakes up: its execution no longer holds the job, so nothing is written.
    late = dead.end_call(first, "finished", _result("finished", job_id), {"event": "done"}, {})
    assert dead.scripts.call(late) == [0]
    assert redis_client.exists(f"pagedq:result:{job_id}") == 0

    second = reaper.dequeue()
    assert second.attempt == 2 and second.execution != first.execution
    time.sleep(1.1)
    assert reaper.reap() == ([], [job_id])
    job = _fetch(redis_client, job_id)
    assert job.get_status() == "failed"
    assert "in flight during 2 worker crashes" in job.latest_result().exc_string
    assert _registries(redis_client)["failed"] == [job_id]
    result = json.loads(redis_client.get(f"pagedq:result:{job_id}"))
    assert result["status"] == "failed" and "2 worker crashes" in result["error"]


def test_heartbeat_renews_held_leases_and_reports_lost_ones(redis_client):
    client = Client(connection=redis_client, queue=QUEUE)
    kept, lost = client.submit(prompt="a"), client.submit(prompt="b")
    adapter = _adapter(redis_client, lease_ttl=1)
    claims = {c.job_id: c for c in (adapter.dequeue(), adapter.dequeue())}
    redis_client.zrem(f"rq:wip:{QUEUE}", claims[lost].member)  # as a reaper would
    call = adapter.heartbeat_call(list(claims.values()), "busy")

    assert adapter.scripts.call(call) == [claims[lost].member.encode()]
    score = redis_client.zscore(f"rq:wip:{QUEUE}", claims[kept].member)
    assert score > time.time() + 0.5
    assert redis_client.hget("rq:worker:w1", "state") == b"busy"


def test_requeue_puts_the_job_at_the_front_and_a_crash_counts(redis_client):
    client = Client(connection=redis_client, queue=QUEUE)
    job_id, other = client.submit(prompt="a"), client.submit(prompt="b")
    adapter = _adapter(redis_client, max_crashes=1)
    claim = adapter.dequeue()
    call = adapter.requeue_call(claim, count_crash=False, result={}, reason="stopping")
    assert adapter.scripts.call(call) == 1
    assert redis_client.lrange(f"rq:queue:{QUEUE}", 0, -1) == [job_id.encode(), other.encode()]

    claim = adapter.dequeue()
    crash = adapter.requeue_call(
        claim, count_crash=True, result={"job_id": job_id}, reason="engine crashed"
    )
    assert adapter.scripts.call(crash) == 2
    assert _fetch(redis_client, job_id).get_status() == "failed"


def test_jobs_asking_for_a_model_go_to_that_models_queue(redis_client):
    client = Client(connection=redis_client, queue=QUEUE)
    gguf = "/somewhere/SmolLM2-135M-Instruct.Q4_1.gguf"
    ids = [client.submit(prompt="x", model=m) for m in ("smollm2", gguf)]
    plain = client.submit(prompt="y")

    assert canonical_model("HuggingFaceTB/SmolLM2-135M-Instruct") == canonical_model(gguf)
    model_key = f"rq:queue:{model_queue(QUEUE, 'smollm2')}"
    assert redis_client.lrange(model_key, 0, -1) == [i.encode() for i in ids]
    assert redis_client.lrange(f"rq:queue:{QUEUE}", 0, -1) == [plain.encode()]
    assert model_key.encode() in redis_client.smembers("rq:queues")
    # A worker serving the model tries its model's queue first, then the shared one.
    adapter = _adapter(redis_client)
    assert [adapter.dequeue().job_id for _ in range(3)] == [*ids, plain]
    assert _fetch(redis_client, ids[0]).origin == model_queue(QUEUE, "smollm2")
    other = Driver(RQAdapter(
        redis_client, "w2", [model_queue(QUEUE, "other/model"), QUEUE],
        lease_ttl=5, result_ttl=5, stream_ttl=5, max_crashes=2,
    ))  # fmt: skip
    client.submit(prompt="z", model="smollm2")
    assert other.dequeue() is None


def test_registration_is_what_rq_lists_and_a_stale_name_is_taken_over(redis_client):
    adapter = _adapter(redis_client, lease_ttl=1)
    assert adapter.register()
    workers = Worker.all(connection=redis_client)
    assert [w.name for w in workers] == ["w1"]
    assert {q.name for q in workers[0].queues} == {QUEUE, model_queue(QUEUE, "smollm2")}
    assert not _adapter(redis_client, lease_ttl=1).register()  # live: refused
    time.sleep(1.1)
    assert _adapter(redis_client, lease_ttl=1).register()  # stale: taken over
    adapter.unregister()
    assert Worker.all(connection=redis_client) == []


def test_scripts_reload_after_script_flush(redis_client):
    Client(connection=redis_client, queue=QUEUE).submit(prompt="hi")
    adapter = _adapter(redis_client)
    assert adapter.dequeue() is not None  # loads the scripts
    Client(connection=redis_client, queue=QUEUE).submit(prompt="hi again")
    redis_client.script_flush()
    assert adapter.dequeue() is not None


@pytest.mark.parametrize(
    "raw, seconds",
    [("", 60), ("30", 30), ("90s", 60), ("1m", 60), ("0.5", 0.5), ("-1", 60), ("1h", 60),
     ("abc", 60), ("nan", 60), ("inf", 60)],
)  # fmt: skip
def test_job_timeout_is_rqs_field_capped_by_the_worker(raw, seconds):
    claim = Claim("j", QUEUE, "e", 1, b"", "", raw, False)
    assert claim.timeout_s(60) == seconds


class _Recorder(BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.requests.append(self.path)
        self.send_response(200)
        self.end_headers()

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


def test_callbacks_and_webhooks_named_by_a_job_hash_are_never_called(
    redis_client, tmp_path, monkeypatch
):
    monkeypatch.setenv(MARKER_DIR_ENV, str(tmp_path))
    server = HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hook"
    client = Client(connection=redis_client, queue=QUEUE)
    ids = [client.submit(prompt=f"p{i}") for i in range(4)]
    callback = f"{__name__}.marker_callback"
    hooks = [{"url": url, "job_status": s, "method": "POST"} for s in
             ("finished", "failed", "canceled", "stopped")]  # fmt: skip
    for job_id in ids:
        redis_client.hset(
            f"rq:job:{job_id}",
            mapping={
                "success_callback_name": callback,
                "failure_callback_name": callback,
                "stopped_callback_name": callback,
                "webhooks": json.dumps(hooks),
            },
        )
    adapter = _adapter(redis_client, lease_ttl=1, max_crashes=1)
    claims = [adapter.dequeue() for _ in ids]
    final = {"event": "done"}
    adapter.scripts.run(
        [
            adapter.end_call(claims[0], "finished", _result("finished", ids[0]), final, {}),
            adapter.end_call(claims[1], "failed", _result("failed", ids[1]), final),
            adapter.end_call(claims[2], "canceled", _result("canceled", ids[2]), final),
        ]
    )
    time.sleep(1.1)
    assert adapter.reap() == ([], [ids[3]])  # the reaper path, out of crashes

    statuses = [_fetch(redis_client, j).get_status() for j in ids]
    assert statuses == ["finished", "failed", "canceled", "failed"]
    time.sleep(0.2)
    server.shutdown()
    assert _Recorder.requests == []
    assert not (tmp_path / "called").exists()


def test_job_data_is_read_compressed_or_not_and_a_zip_bomb_is_refused():
    import zlib

    payload = json.dumps(["pagedq.generate", None, [{"prompt": "hi"}], {}]).encode()
    for data in (payload, zlib.compress(payload)):
        claim = Claim("j", QUEUE, "e", 1, data, "", "", False)
        assert load_job_data(claim.data, 2**20)[2] == [{"prompt": "hi"}]
    bomb = zlib.compress(b"[" + b" " * (64 * 1024 * 1024) + b"]")
    with pytest.raises(ValueError, match="inflates to more than max_payload_bytes=1048576"):
        load_job_data(Claim("j", QUEUE, "e", 1, bomb, "", "", False).data, 2**20)


def test_one_dequeue_takes_many_jobs_in_the_order_single_dequeues_take_them(redis_client):
    """A batch dequeue is the same fair pick, job after job: priorities, tenants, order."""

    def fill(r):
        client = Client(connection=r, queue=QUEUE)
        for i in range(6):
            client.submit(prompt=f"a{i}", tenant="a", max_tokens=8)
            client.submit(prompt=f"b{i}", tenant="b", max_tokens=32)
        client.submit(prompt="urgent", priority=-1)
        client.submit(prompt="later", priority=1)

    fill(redis_client)
    one_by_one = [_adapter(redis_client).dequeue() for _ in range(14)]
    assert _adapter(redis_client).dequeue() is None
    redis_client.flushdb()
    fill(redis_client)
    batched = _adapter(redis_client).dequeue_many(5)
    batched += _adapter(redis_client).dequeue_many(20)

    def prompts(claims):
        return [load_job_data(c.data, 2**20)[2][0]["prompt"] for c in claims]

    assert len(batched) == 14 and prompts(batched) == prompts(one_by_one)
    assert prompts(batched)[0] == "urgent" and prompts(batched)[-1] == "later"
    assert len({c.execution for c in batched}) == 14
    started = [m for k in redis_client.keys("rq:wip:*") for m in redis_client.zrange(k, 0, -1)]
    assert sorted(started) == sorted(c.member.encode() for c in batched)
    assert not [k for k in redis_client.keys("rq:queue:*") if redis_client.llen(k)]


def test_a_batch_dequeue_skips_stale_entries_and_reports_cancel_keys(redis_client):
    client = Client(connection=redis_client, queue=QUEUE)
    ids = [client.submit(prompt=f"p{i}") for i in range(4)]
    redis_client.delete(f"rq:job:{ids[1]}")  # gone: a stale queue entry
    redis_client.set(f"pagedq:cancel:{ids[2]}", "1")
    claims = _adapter(redis_client).dequeue_many(8)

    assert [c.job_id for c in claims] == [ids[0], ids[2], ids[3]]
    assert [c.canceled for c in claims] == [False, True, False]
    assert redis_client.llen(f"rq:queue:{QUEUE}") == 0


def test_merged_endings_end_each_job_once_and_count_the_worker_and_tenants_once(redis_client):
    client = Client(connection=redis_client, queue=QUEUE)
    ids = [client.submit(prompt=f"p{i}", tenant="t", max_tokens=4) for i in range(3)]
    adapter = _adapter(redis_client)
    adapter.scripts.call(adapter.register_call())
    claims = adapter.dequeue_many(3)
    usage = {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    calls = [
        adapter.end_call(c, "finished", _result("finished", c.job_id, **usage), {}) for c in claims
    ]
    [merged] = adapter.merge_ends(calls)

    assert adapter.scripts.call(merged) == [1, 1, 1]
    assert adapter.scripts.call(merged) == [2, 2, 2]  # repeated: nothing written twice
    assert sorted(_registries(redis_client, claims[0].queue)["finished"]) == sorted(ids)
    assert redis_client.hget("rq:worker:w1", "successful_job_count") == b"3"
    assert redis_client.hget(f"pagedq:tenant-tokens:{QUEUE}", "t") == b"21"
    # A job that does not stream gets no stream at all, and a pagedq job no RQ result stream
    # unless the worker says `all` (this adapter does).
    assert not any(redis_client.exists(f"pagedq:stream:{j}") for j in ids)
    assert all(redis_client.exists(f"rq:results:{j}") for j in ids)


def test_rq_result_entries_go_only_to_plain_rq_jobs_by_default(redis_client):
    from rq import Queue

    pagedq_id = Client(connection=redis_client, queue=QUEUE).submit(prompt="hi")
    plain = Queue(QUEUE, connection=redis_client, serializer=JSONSerializer).enqueue(
        "pagedq.generate", {"prompt": "hi"}
    )
    adapter = _adapter(redis_client, rq_results="plain")
    claims = {c.job_id: c for c in adapter.dequeue_many(2)}
    assert claims[plain.id].plain and not claims[pagedq_id].plain
    for job_id, claim in claims.items():
        result = _result("finished", job_id)
        assert adapter.scripts.call(adapter.end_call(claim, "finished", result, {}, {})) == [1]

    assert _fetch(redis_client, plain.id).latest_result().type == Result.Type.SUCCESSFUL
    assert _fetch(redis_client, pagedq_id).get_status() == "finished"
    assert not redis_client.exists(f"rq:results:{pagedq_id}")
    with pytest.raises(ValueError, match="rq_results: 'some'; allowed: \\['plain', 'all'\\]"):
        RQAdapter(redis_client, "w", [QUEUE], lease_ttl=1, result_ttl=1, stream_ttl=1,
                  max_crashes=1, rq_results="some")  # fmt: skip


def test_an_ending_tells_its_producers_events_stream_only_while_it_exists(redis_client):
    from producer.events import EventFollower

    client = Client(connection=redis_client, queue=QUEUE)
    follower = EventFollower(redis_client, notify="run1")
    follower.open()
    [job_id] = client.enqueue([_as_request({"prompt": "hi"})], notify="run1")
    [orphan] = client.enqueue([_as_request({"prompt": "ho"})], notify="gone")
    follower.add(job_id)
    adapter = _adapter(redis_client)
    for claim in adapter.dequeue_many(2):
        result = _result("finished", claim.job_id)
        adapter.scripts.call(adapter.end_call(claim, "finished", result, {}, {}))

    assert follower.read(1.0) == [(job_id, {"event": "done", "status": "result"})]
    assert len(follower) == 0
    assert not redis_client.exists("pagedq:events:gone") and orphan
    assert 0 < redis_client.ttl("pagedq:events:run1") <= 3600


def test_a_merged_ending_tells_an_events_stream_once_for_all_its_jobs(redis_client):
    """Jobs of one producer ended in one call share one events entry (ids and statuses in
    order); the follower also reads the one-job entries of older workers."""
    from producer.events import EventFollower

    client = Client(connection=redis_client, queue=QUEUE)
    follower = EventFollower(redis_client, notify="run2")
    follower.open()
    ids = client.enqueue([_as_request({"prompt": f"p{i}"}) for i in range(3)], notify="run2")
    for job_id in ids:
        follower.add(job_id)
    adapter = _adapter(redis_client)
    claims = adapter.dequeue_many(3)
    statuses = ["finished", "failed", "finished"]
    calls = [
        adapter.end_call(c, s, _result(s, c.job_id), {}, {})
        for c, s in zip(claims, statuses, strict=True)
    ]
    [merged] = adapter.merge_ends(calls)
    assert adapter.scripts.call(merged) == [1, 1, 1]

    entries = redis_client.xrange("pagedq:events:run2")
    assert [e[b"event"] for _, e in entries[:1]] == [b"open"] and len(entries) == 2
    ended = entries[1][1]
    assert ended[b"jobs"].decode().split() == [c.job_id for c in claims]
    assert ended[b"statuses"].decode().split() == statuses
    assert sorted(j for j, _ in follower.read(1.0)) == sorted(ids)

    follower.add("legacy")
    redis_client.xadd("pagedq:events:run2", {"job_id": "legacy", "status": "finished"})
    assert follower.read(1.0) == [("legacy", {"event": "done", "status": "result"})]


def test_token_entries_and_final_entries_tell_their_hubs_wake_stream(redis_client):
    """A step's entries list the jobs of each stream hub in one wake entry per hub; a final
    entry tells it too; a job enqueued without a wake id tells no one; the job stays online."""
    client = Client(connection=redis_client, queue=QUEUE)
    a, b = client.enqueue([_as_request({"prompt": p}) for p in ("a", "b")], wake="hub1")
    [c] = client.enqueue([_as_request({"prompt": "c"})], wake="hub2")
    [d] = client.enqueue([_as_request({"prompt": "d"})])
    adapter = _adapter(redis_client)
    claims = {claim.job_id: claim for claim in adapter.dequeue_many(4)}
    assert not any(claim.bulk for claim in claims.values())
    step = [(claims[j], {"event": "delta", "delta": "x"}, True) for j in (a, b, c, d)]
    assert adapter.stream(step) == []

    def wakes(hub: str) -> list[list[str]]:
        entries = redis_client.xrange(f"pagedq:wake:{hub}")
        return [sorted(fields[b"jobs"].decode().split()) for _, fields in entries]

    assert wakes("hub1") == [sorted([a, b])] and wakes("hub2") == [[c]]
    assert 0 < redis_client.ttl("pagedq:wake:hub1") <= 3600
    final = {"event": "done", "status": "result"}
    for job_id in (b, c, d):
        call = adapter.end_call(claims[job_id], "finished", _result("finished", job_id), final)
        assert adapter.scripts.call(call) == [1]
    assert wakes("hub1") == [sorted([a, b]), [b]] and wakes("hub2") == [[c], [c]]
    assert sorted(redis_client.keys("pagedq:wake:*")) == [b"pagedq:wake:hub1", b"pagedq:wake:hub2"]

    # The fence: once another worker's reaper took its leases (it was taken for dead), an
    # execution that no longer holds its job (taken, ended or put back) writes nothing.
    other = _adapter(redis_client, name="w2")
    assert other.scripts.call(other.adapter.reap_call(dead_holder="w1")) == [[a.encode()], []]
    lengths = {j: redis_client.xlen(f"pagedq:stream:{j}") for j in (a, b, c, d)}
    assert sorted(adapter.stream(step)) == sorted([a, b, c, d])
    assert {j: redis_client.xlen(f"pagedq:stream:{j}") for j in (a, b, c, d)} == lengths
    assert wakes("hub1") == [sorted([a, b]), [b]]


def test_stream_checks_each_lease_only_after_a_reaper_moved_the_workers_fence(redis_client):
    """While no reaper took a lease of the worker's jobs in a queue, a STREAM call reads no
    lease there (one GET of the worker's fence, whatever the number of jobs); once one did,
    the next call checks every lease, refuses the lost job's entries, writes the others', and
    the calls after it read no lease again. Another worker's fence is not this one's."""
    client = Client(connection=redis_client, queue=QUEUE)
    *ids, theirs = client.enqueue([_as_request({"prompt": f"p{i}"}) for i in range(4)])
    adapter, bystander = _adapter(redis_client), _adapter(redis_client, name="w3")
    claims = {claim.job_id: claim for claim in adapter.dequeue_many(3)}
    [their_claim] = bystander.dequeue_many(1)
    assert sorted(claims) == sorted(ids) and their_claim.job_id == theirs
    delta = {"event": "token", "delta": "x", "token_ids": "[7]"}

    def zmscores() -> int:
        return redis_client.info("commandstats").get("cmdstat_zmscore", {}).get("calls", 0)

    def lengths() -> dict[str, int]:
        return {j: redis_client.xlen(f"pagedq:stream:{j}") for j in ids}

    step = [(claims[j], delta, False) for j in ids]
    before = zmscores()
    assert adapter.stream(step) == [] and adapter.stream(step) == []
    assert zmscores() == before and lengths() == dict.fromkeys(ids, 2)

    # A reaper takes the first job's expired lease: the worker's fence in its queue moves.
    lost = claims[ids[0]]
    redis_client.zadd(f"rq:wip:{lost.queue}", {lost.member: 0}, xx=True)
    other = _adapter(redis_client, name="w2")
    assert other.reap() == ([ids[0]], [])
    fence = fence_key(lost.queue, lost.execution[:EXECUTION_PREFIX_CHARS])
    assert redis_client.get(fence) == b"1"
    assert bystander.stream([(their_claim, delta, True)]) == [] and zmscores() == before
    assert adapter.stream(step) == [ids[0]]
    assert zmscores() == before + 1
    assert lengths() == {ids[0]: 2, ids[1]: 3, ids[2]: 3}
    rest = step[1:]
    assert adapter.stream(rest) == [] and zmscores() == before + 1
    assert lengths() == {ids[0]: 2, ids[1]: 4, ids[2]: 4}


def test_a_hub_of_deltas_gets_no_job_ids_and_a_moved_fence_reads_them_from_its_entries(
    redis_client,
):
    """A STREAM call gives a hub of deltas its entries' JSON and leases, not the job ids again;
    once a reaper moved the fence, the script reads the ids from the JSON's keys, in order,
    whatever the text of the deltas (quotes, brackets, backslashes), and refuses exactly the
    job whose lease was lost."""
    hub = "hub9" + DELTAS_WAKE
    client = Client(connection=redis_client, queue=QUEUE)
    ids = client.enqueue([_as_request({"prompt": f"p{i}"}) for i in range(3)], wake=hub)
    adapter = _adapter(redis_client)
    claims = {claim.job_id: claim for claim in adapter.dequeue_many(3)}
    texts = ['"]},{"x":[', "a\\", "[{}]"]
    step = [(claims[j], {"event": "token", "delta": t}, False) for j, t in zip(ids, texts)]
    call = adapter.adapter.stream_call(step)
    assert not any(j in str(arg) for j in ids for arg in call.args[-2:])  # ids '', leases
    lost = claims[ids[1]]
    redis_client.zadd(f"rq:wip:{lost.queue}", {lost.member: 0}, xx=True)
    assert _adapter(redis_client, name="w2").reap() == ([ids[1]], [])
    assert adapter.stream(step) == [ids[1]]
    [(_, written)] = redis_client.xrange(f"pagedq:wake:{hub}")
    assert inline_entries(written) == {
        ids[0]: [{"event": "token", "delta": texts[0]}],
        ids[2]: [{"event": "token", "delta": texts[2]}],
    }


RESTART = {"event": "restart"}


def _two_hub_jobs_streamed(redis_client, hub: str, delta: dict):
    """Two jobs enqueued for `hub` and claimed, then one step streamed: RESTART and `delta` for
    the first, `delta` for the second. Returns the client, the adapter, the claims by job id
    and the two job ids."""
    client = Client(connection=redis_client, queue=QUEUE)
    a, b = client.enqueue([_as_request({"prompt": p}) for p in ("a", "b")], wake=hub)
    adapter = _adapter(redis_client)
    claims = {claim.job_id: claim for claim in adapter.dequeue_many(2)}
    step = [(claims[a], RESTART, True), (claims[a], delta, False), (claims[b], delta, True)]
    assert adapter.stream(step) == []
    return client, adapter, claims, (a, b)


def test_an_inline_hubs_jobs_get_their_entries_in_its_wake_stream_only(redis_client):
    """For a hub whose wake id is inline, one wake entry per call carries the entries of all its
    jobs (a JSON object by job, each job's entries in order), and no job stream is written; the
    final entry comes the same way; the fence holds as for job streams."""
    hub, delta = "hub3" + INLINE_WAKE, {"event": "token", "delta": "x", "token_ids": "[7]"}
    client, adapter, claims, (a, b) = _two_hub_jobs_streamed(redis_client, hub, delta)

    def wake_entries() -> list[tuple[list[str], dict]]:
        out = []
        for _, fields in redis_client.xrange(f"pagedq:wake:{hub}"):
            jobs = sorted(fields[b"jobs"].decode().split())
            out.append((jobs, decode_inline(fields[ENTRIES_FIELD.encode()].decode())))
        return out

    assert wake_entries() == [(sorted([a, b]), {a: [RESTART, delta], b: [delta]})]
    call = adapter.end_call(claims[b], "finished", _result("finished", b), {"event": "done"})
    assert adapter.scripts.call(call) == [1]
    assert wake_entries()[1] == ([b], {b: [{"event": "done"}]})
    assert redis_client.keys("pagedq:stream:*") == []
    assert 0 < redis_client.ttl(f"pagedq:wake:{hub}") <= 3600

    # A job whose lease a reaper took is left out of the hub's entry (so is one that ended); the
    # others' entries go in.
    [c] = client.enqueue([_as_request({"prompt": "c"})], wake=hub)
    [claims[c]] = adapter.dequeue_many(1)
    redis_client.zadd(f"rq:wip:{claims[a].queue}", {claims[a].member: 0}, xx=True)
    assert _adapter(redis_client, name="w2").reap() == ([a], [])
    step2 = [(claims[a], delta, False), (claims[b], delta, False), (claims[c], delta, True)]
    assert sorted(adapter.stream(step2)) == sorted([a, b])
    assert wake_entries()[2] == ([c], {c: [delta]})


def test_an_inline_hub_jobs_last_tokens_go_with_its_end_and_only_if_it_ends(redis_client):
    """An END given the job's entries not written yet (an inline hub's job: no STREAM call for
    its last tokens) puts them, then its final entry, in the hub's wake entry; an END refused
    (the lease was lost) writes none of them; a job without an inline hub cannot take them."""
    hub, delta = "hub6" + DELTAS_WAKE, {"event": "token", "delta": "x", "token_ids": "[7]"}
    client, adapter, claims, (a, b) = _two_hub_jobs_streamed(redis_client, hub, delta)
    last = {"event": "token", "delta": " end", "token_ids": "[8, 9]"}
    result = _result("finished", b)
    call = adapter.end_call(
        claims[b], "finished", result, {"event": "done", "finish_reason": "stop"}, entries=[last]
    )
    assert adapter.scripts.call(call) == [1]
    [_, (_, fields)] = redis_client.xrange(f"pagedq:wake:{hub}")
    assert json.loads(fields[ENTRIES_FIELD.encode()]) == {
        b: [" end", {"event": "done", "finish_reason": "stop"}]
    }

    redis_client.zadd(f"rq:wip:{claims[a].queue}", {claims[a].member: 0}, xx=True)
    assert _adapter(redis_client, name="w2").reap() == ([a], [])
    refused = adapter.end_call(claims[a], "finished", _result("finished", a), {"event": "done"},
                               entries=[last])  # fmt: skip
    assert adapter.scripts.call(refused) == [0]
    assert len(redis_client.xrange(f"pagedq:wake:{hub}")) == 2

    [c] = client.enqueue([_as_request({"prompt": "c"})])  # no hub; `a` is queued again too
    claim = {claim.job_id: claim for claim in adapter.dequeue_many(2)}[c]
    with pytest.raises(ValueError, match="inline hub"):
        adapter.end_call(claim, "finished", _result("finished", c), {"event": "done"},
                         entries=[last])  # fmt: skip


def test_a_worker_renews_a_hubs_wake_stream_ttl_on_its_first_call_then_each_quarter_ttl(
    redis_client, monkeypatch
):
    """The first STREAM or END call of a worker to a hub gives the hub's wake stream its TTL;
    later calls leave it alone until a quarter of the TTL has passed on the worker's clock,
    whose milliseconds less WAKE_RETAIN_MS are the oldest entry id an inline stream keeps."""
    hub, delta = "hub5" + DELTAS_WAKE, {"event": "token", "delta": "x", "token_ids": "[7]"}
    client, adapter, claims, (a, b) = _two_hub_jobs_streamed(redis_client, hub, delta)
    key = f"pagedq:wake:{hub}"
    assert WAKE_TTL_S - 5 <= redis_client.ttl(key) <= WAKE_TTL_S
    redis_client.persist(key)  # as if the stream had lost its TTL (evicted, written again)
    assert adapter.stream([(claims[a], delta, False)]) == []
    call = adapter.end_call(claims[b], "finished", _result("finished", b), {"event": "done"})
    assert adapter.scripts.call(call) == [1]
    assert redis_client.ttl(key) == -1
    assert len(redis_client.xrange(key)) == 3

    later = time.time() + WAKE_TTL_S / 4 + 1
    monkeypatch.setattr("worker.rq_adapter.time.time", lambda: later)
    call = adapter.end_call(claims[a], "finished", _result("finished", a), {"event": "done"})
    assert adapter.scripts.call(call) == [1]
    assert WAKE_TTL_S - 5 <= redis_client.ttl(key) <= WAKE_TTL_S
    assert adapter.wake_args([hub]) == {
        "wake_minid": str(int(later * 1000) - WAKE_RETAIN_MS),
        "wake_ttl": 0,  # renewed by the call just made
    }


def test_a_hub_of_deltas_gets_each_token_entry_as_its_text_alone_and_no_job_list(redis_client):
    """A wake id ending in DELTAS_WAKE (the gateway's): a token entry goes into `entries` as
    the JSON string of its delta (no event, no token ids), other entries as objects, and the
    wake entry has no `jobs` field; readers decode the same entries, less the token ids."""
    hub, delta = "hub4" + DELTAS_WAKE, {"event": "token", "delta": "x y", "token_ids": "[7]"}
    client, adapter, claims, (a, b) = _two_hub_jobs_streamed(redis_client, hub, delta)
    [(_, fields)] = redis_client.xrange(f"pagedq:wake:{hub}")
    assert set(fields) == {ENTRIES_FIELD.encode()}
    assert json.loads(fields[ENTRIES_FIELD.encode()]) == {a: [RESTART, "x y"], b: ["x y"]}
    text = {"event": "token", "delta": "x y"}
    assert inline_entries(fields) == {a: [RESTART, text], b: [text]}
    assert inline_job_ids(fields, inline_entries(fields)) == [a, b]

    call = adapter.end_call(claims[b], "finished", _result("finished", b), {"event": "done"})
    assert adapter.scripts.call(call) == [1]
    [_, (_, fields)] = redis_client.xrange(f"pagedq:wake:{hub}")
    assert set(fields) == {ENTRIES_FIELD.encode()}
    assert inline_entries(fields) == {b: [{"event": "done"}]}
    assert redis_client.keys("pagedq:stream:*") == []

    # A job whose lease a reaper took is left out (re-encoded without it), the other goes in.
    [c] = client.enqueue([_as_request({"prompt": "c"})], wake=hub)
    [claims[c]] = adapter.dequeue_many(1)
    redis_client.zadd(f"rq:wip:{claims[a].queue}", {claims[a].member: 0}, xx=True)
    assert _adapter(redis_client, name="w2").reap() == ([a], [])
    assert adapter.stream([(claims[a], delta, False), (claims[c], delta, True)]) == [a]
    [*_, (_, fields)] = redis_client.xrange(f"pagedq:wake:{hub}")
    assert set(fields) == {ENTRIES_FIELD.encode()}
    assert inline_entries(fields) == {c: [text]}


def test_a_steps_entries_and_endings_go_in_one_step_call(redis_client):
    """A step with token entries and endings of one shard is one STEP call (one EVALSHA): a hub
    gets the window's deltas of one job, then the last tokens and final entry of another,
    whose staged result becomes its result key; a job with a stream of its own gets its
    tokens before its final entry; a job whose lease was lost is refused alone, in either
    part."""
    hub, delta = "hub7" + DELTAS_WAKE, {"event": "token", "delta": "x", "token_ids": "[7]"}
    client, adapter, claims, (a, b) = _two_hub_jobs_streamed(redis_client, hub, delta)
    [c, d] = client.enqueue([_as_request({"prompt": p}) for p in ("c", "d")])  # own streams
    claims |= {claim.job_id: claim for claim in adapter.dequeue_many(2)}
    last, done = {"event": "token", "delta": " end", "token_ids": "[8]"}, {"event": "done"}
    tokens = {"event": "token", "delta": " y", "token_ids": "[9]"}

    def step(entries, ends):
        call = adapter.step_call(adapter.stream_call(entries), adapter.merge_ends(ends))
        assert call is not None and call.script is STEP
        return adapter.scripts.call(call)

    result_b = _result("finished", b)
    ends = [
        adapter.end_call(claims[b], "finished", result_b, done, entries=[last], staged=True),
        adapter.end_call(claims[d], "finished", _result("finished", d), done),
    ]  # fmt: skip
    adapter.scripts.run([adapter.stage_result(claims[b], json.dumps(result_b))])
    assert step([(claims[a], delta, False), (claims[d], tokens, True)], ends) == [0, [1, 1]]
    [_, (_, window), (_, ended)] = redis_client.xrange(f"pagedq:wake:{hub}")
    assert inline_entries(window) == {a: [{"event": "token", "delta": "x"}]}
    assert inline_entries(ended) == {b: [{"event": "token", "delta": " end"}, done]}
    assert json.loads(redis_client.get(f"pagedq:result:{b}")) == result_b
    assert [f for _, f in redis_client.xrange(f"pagedq:stream:{d}")] == [
        {k.encode(): v.encode() for k, v in entry.items()} for entry in (tokens, done)
    ]
    assert {_fetch(redis_client, j).get_status() for j in (b, d)} == {"finished"}

    # A reaper took a's and c's leases: their entry and ending are refused, the others written.
    for j in (a, c):
        redis_client.zadd(f"rq:wip:{claims[j].queue}", {claims[j].member: 0}, xx=True)
    assert sorted(_adapter(redis_client, name="w2").reap()[0]) == sorted([a, c])
    e, f = client.enqueue([_as_request({"prompt": p}) for p in ("e", "f")], wake=hub)
    claims |= {claim.job_id: claim for claim in adapter.dequeue_many(4) if claim.job_id in (e, f)}
    ends = [adapter.end_call(claims[j], "finished", _result("finished", j), done) for j in (c, f)]
    streamed, ended = step([(claims[a], delta, False), (claims[e], delta, True)], ends)
    assert adapter.stream_lost(streamed) == [a] and ended == [0, 1]
    [*_, (_, window), (_, ended)] = redis_client.xrange(f"pagedq:wake:{hub}")
    assert inline_entries(window) == {e: [{"event": "token", "delta": "x"}]}
    assert inline_entries(ended) == {f: [done]}
    assert c not in _registries(redis_client)["finished"]


def test_a_job_whose_end_goes_to_an_events_stream_or_a_batch_is_claimed_as_bulk(redis_client):
    client = Client(connection=redis_client, queue=QUEUE)
    [alone] = client.enqueue([_as_request({"prompt": "a"})])
    [notified] = client.enqueue([_as_request({"prompt": "b"})], notify="run2")
    [in_batch] = client.enqueue([_as_request({"prompt": "c"})], batch_id="batch_x")
    claims = {c.job_id: c for c in _adapter(redis_client).dequeue_many(3)}
    assert {j: c.bulk for j, c in claims.items()} == {alone: False, notified: True, in_batch: True}


def test_bulk_jobs_are_claimed_ahead_only_while_as_many_stay_queued(redis_client):
    """`ahead` (a worker's --prefetch): after the jobs it has room for, a dequeue takes bulk
    jobs more, in the fair pick's order, while `ahead` jobs would stay queued; it never takes
    a job somebody waits on alone ahead, nor the last jobs another worker could run now."""
    client = Client(connection=redis_client, queue=QUEUE)
    bulk = client.enqueue([_as_request({"prompt": f"b{i}"}) for i in range(12)], notify="run")
    w1, w2 = _adapter(redis_client, name="w1"), _adapter(redis_client, name="w2")

    # Room for 1, 4 ahead: 12 queued, 1 + 4 taken, 7 stay.
    assert [c.job_id for c in w1.dequeue_many(1, 4)] == bulk[:5]
    # Nothing room, 4 ahead: 7 queued, only 3 can go with 4 staying queued.
    assert [c.job_id for c in w2.dequeue_many(0, 4)] == bulk[5:8]
    assert w2.dequeue_many(0, 4) == []
    # Room always claims, whatever is left.
    assert [c.job_id for c in w1.dequeue_many(4, 4)] == bulk[8:12]

    # An interactive job at the head stops the claims ahead (it waits for a worker with room).
    first = client.enqueue([_as_request({"prompt": f"c{i}"}) for i in range(8)], notify="run")
    [alone] = client.enqueue([_as_request({"prompt": "alone"})])
    rest = client.enqueue([_as_request({"prompt": f"d{i}"}) for i in range(8)], notify="run")
    assert [c.job_id for c in w1.dequeue_many(2, 8)] == first
    assert [c.job_id for c in w2.dequeue_many(1, 4)] == [alone, *rest[:4]]
    assert redis_client.llen(f"rq:queue:{QUEUE}") == 4


def _as_request(body: dict):
    from producer.contract.schema import GenerationRequest

    return GenerationRequest.model_validate(body)

"""Real worker processes against a real redis-server (AOF, an ACL user): what must survive.

One module, few processes (each loads a model): R serves smollm2 as an ACL user; M serves a
tiny random Llama on the same queue; K1 and K2 serve the tiny model too but sleep right after
their dequeue script (a test-only hook) so they can be killed there. Tests run in file order
and share these workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import redis
from rq.job import Job
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from worker_helpers import REPO, WorkerProcess, make_client

from producer.contract.keys import GENERATE_FUNC
from producer.contract.routing import model_queue
from worker.redis_server import PrivateRedis, free_port

pytestmark = pytest.mark.slow

QUEUE = "q-rel"
SMOL_QUEUE = model_queue(QUEUE, "smollm2")
METRICS_PORT = free_port()
PASSWORD = "s3cret-pw-xyz"
ACL_RULES = ["on", f">{PASSWORD}", "~*", "&*", "+@all"]
TESTS_DIR = Path(__file__).resolve().parent


class _Recorder(BaseHTTPRequestHandler):
    paths: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.paths.append(self.path)
        self.send_response(200)
        self.end_headers()

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    # The user is in the server's own configuration, so that it exists from the first
    # connection after every restart: a worker that reconnects in between would be refused
    # (a final error: it exits), as it is by a Redis that really lost the user.
    with PrivateRedis(appendonly=True, args=["--user", "pagedq", *ACL_RULES]) as s:
        yield s


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    """A local HTTP server that records any webhook call, and the callback marker path."""
    http = HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    marker = tmp_path_factory.mktemp("marker") / "callback-ran"
    yield f"http://127.0.0.1:{http.server_port}/hook", marker
    http.shutdown()


@pytest.fixture(scope="module")
def workers(server, hooks, tmp_path_factory, tiny_llama_dir):
    log_dir = tmp_path_factory.mktemp("rel-logs")
    env = {
        "PAGEDQ_TEST_MARKER": str(hooks[1]),
        "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO)]),
        "OMP_NUM_THREADS": "1",
    }
    acl_url = server.url.replace("redis://", f"redis://pagedq:{PASSWORD}@")
    hook = {**env, "PAGEDQ_TEST_SLEEP_AFTER_DEQUEUE": "600"}
    # RQ's result stream on every job: one entry per end, the witness of "ended once".
    every = ("--rq-results", "all")
    started = {
        "R": WorkerProcess(acl_url, QUEUE, "rel-r", log_dir, "--metrics-port", str(METRICS_PORT),
                           *every, env=env, lease_ttl=2),
        "K1": WorkerProcess(server.url, QUEUE, "rel-k1", log_dir, *every, env=hook, lease_ttl=2,
                            model=tiny_llama_dir),
        "K2": WorkerProcess(server.url, QUEUE, "rel-k2", log_dir, *every, env=hook, lease_ttl=2,
                            model=tiny_llama_dir),
        "M": WorkerProcess(server.url, QUEUE, "rel-m", log_dir, *every, env=env, lease_ttl=2,
                           model=tiny_llama_dir),
    }  # fmt: skip
    try:
        for w in started.values():
            w.wait_ready(timeout=900)  # four models load at once on a shared 2-core machine
        yield started
    finally:
        for w in started.values():
            w.stop(timeout=15)


@pytest.fixture(scope="module")
def client(server):
    c = make_client(server.url, QUEUE)
    yield c
    c.close()


def _arm(client, job_id: str, hooks) -> None:
    """Make the job hash ask RQ for callbacks and webhooks, as any Redis client could."""
    url, _ = hooks
    webhooks = [{"url": url, "job_status": s, "method": "POST"}
                for s in ("finished", "failed", "canceled", "stopped")]  # fmt: skip
    client.redis.hset(
        f"rq:job:{job_id}",
        mapping={
            "success_callback_name": "callback_marker.touch",
            "failure_callback_name": "callback_marker.touch",
            "stopped_callback_name": "callback_marker.touch",
            "webhooks": json.dumps(webhooks),
        },
    )


def _wait(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _successes(client, job_id: str) -> list[Result]:
    job = Job.fetch(job_id, connection=client.redis, serializer=JSONSerializer)
    return [r for r in job.results() if r.type == Result.Type.SUCCESSFUL]


def _final_entries(client, job_id: str) -> list[dict]:
    entries = client.redis.xrange(f"pagedq:stream:{job_id}")
    return [f for _, f in entries if f.get(b"event") in (b"done", b"error")]


def _status(client, job_id: str) -> str | None:
    raw = client.redis.hget(f"rq:job:{job_id}", "status")
    return raw.decode() if raw else None


def test_a_worker_killed_right_after_dequeue_leaves_its_job_visible_and_it_reruns(
    workers, client, hooks, tiny_llama_dir
):
    m, k1, k2 = workers["M"], workers["K1"], workers["K2"]
    with k2.paused():
        with m.paused():
            job_id = client.submit(prompt="Name three colors.", model=tiny_llama_dir,
                                   max_tokens=8, temperature=0.0)  # fmt: skip
            _arm(client, job_id, hooks)
            _wait(lambda: _status(client, job_id) == "started", what="K1 to take the job")
            k1.kill()
            # Killed between dequeue and anything else: RQ shows the job started, held by K1.
            tiny_queue = model_queue(QUEUE, tiny_llama_dir)
            registry = StartedJobRegistry(tiny_queue, connection=client.redis)
            assert registry.get_job_ids(cleanup=False) == [job_id]
            assert client.redis.hget(f"rq:job:{job_id}", "worker_name") == b"rel-k1"
        result = client.result(job_id, timeout=120)  # M reaps the lease and re-runs the job

    assert result.status == "finished" and result.worker == "rel-m"
    entries = [f for _, f in client.redis.xrange(f"pagedq:stream:{job_id}")]
    assert entries[0] == {b"event": b"restart"}
    assert "".join(client.stream(job_id, timeout=10)) == result.text
    assert len(_successes(client, job_id)) == 1


def test_a_job_in_flight_during_max_crashes_worker_crashes_fails_with_the_reason(
    workers, client, hooks, tiny_llama_dir
):
    m, k2 = workers["M"], workers["K2"]
    with m.paused():
        job_id = client.submit(prompt="Hello", model=tiny_llama_dir, max_tokens=4)
        _arm(client, job_id, hooks)
        # One crash already happened to this job (counted by the reaper as for any crash).
        client.redis.hset(f"rq:job:{job_id}", "pagedq_crashes", 1)
        _wait(lambda: _status(client, job_id) == "started", what="K2 to take the job")
        k2.kill()
    _wait(lambda: _status(client, job_id) == "failed", what="the reaper to fail the job")

    job = Job.fetch(job_id, connection=client.redis, serializer=JSONSerializer)
    assert "in flight during 2 worker crashes" in job.latest_result().exc_string
    assert [f[b"error"].decode() for f in _final_entries(client, job_id)] == [
        json.loads(client.redis.get(f"pagedq:result:{job_id}"))["error"]
    ]


def test_each_model_runs_only_on_the_worker_serving_it(workers, client, tiny_llama_dir):
    specs = [("smollm2", "rel-r"), ("HuggingFaceTB/SmolLM2-135M-Instruct", "rel-r"),
             (tiny_llama_dir, "rel-m"), (tiny_llama_dir + "/", "rel-m")] * 3  # fmt: skip
    requests = [{"prompt": f"Job {i}", "model": m, "max_tokens": 4} for i, (m, _) in
                enumerate(specs)]  # fmt: skip
    job_ids = client.submit_many(requests)
    results = [client.result(j, timeout=120) for j in job_ids]
    assert [r.worker for r in results] == [w for _, w in specs]
    assert all(r.status == "finished" for r in results)


def test_a_frozen_worker_resumed_after_its_lease_ends_nothing_twice(workers, client):
    r, m = workers["R"], workers["M"]
    held: list[str] = []

    def r_holds_some() -> bool:
        held[:] = [j for j in job_ids if client.redis.hget(f"rq:job:{j}", "worker_name") ==
                   b"rel-r" and _status(client, j) == "started"]  # fmt: skip
        return bool(held)

    # M (a tiny model, fast) would take every job itself: it waits until R holds some.
    with m.paused():
        job_ids = client.submit_many(
            {"prompt": f"Count slowly {i}", "ignore_eos": True, "max_tokens": 16, "stream": True}
            for i in range(8)
        )
        _wait(r_holds_some, what="R to hold jobs")
    with r.paused():
        # M's reaper finds R's expired leases and re-runs R's jobs.
        results = {j: client.result(j, timeout=120) for j in held}
    time.sleep(4)  # R wakes up with outputs for jobs it no longer holds

    assert all(res.worker == "rel-m" for res in results.values())
    for job_id in job_ids:
        assert client.result(job_id, timeout=120).status == "finished"
        assert len(_successes(client, job_id)) == 1
        assert len(_final_entries(client, job_id)) == 1
    finished = FinishedJobRegistry(QUEUE, connection=client.redis)
    assert set(job_ids) <= set(finished.get_job_ids(cleanup=False))
    assert r.process.poll() is None  # R keeps serving
    r.wait_log("lease lost")


def test_a_job_over_its_timeout_fails_with_timeout_and_frees_its_blocks(workers, server):
    r = workers["R"]
    short = make_client(server.url, QUEUE)
    short.job_timeout = 2
    job_id = short.submit(prompt="Tell a long story.", model="smollm2", ignore_eos=True,
                          max_tokens=4000)  # fmt: skip
    with pytest.raises(Exception) as failure:
        short.result(job_id, timeout=60)
    assert "timeout" in str(failure.value)
    _wait(lambda: (r.status() or {}).get("kv_cache_usage") == 0.0, 30, "blocks to be freed")
    short.close()


def test_success_failure_and_cancel_paths_run_no_callback_and_call_no_webhook(
    workers, client, hooks
):
    good = client.submit(prompt="Hi", model="smollm2", max_tokens=4)
    long = client.submit(prompt="Story", model="smollm2", ignore_eos=True, max_tokens=400)
    for job_id in (good, long):
        _arm(client, job_id, hooks)
    bad = client.queue.enqueue(GENERATE_FUNC, {"prompt": "hi", "temprature": 1})
    _arm(client, bad.id, hooks)
    assert client.result(good, timeout=120).status == "finished"
    next(client.stream(long, timeout=120))
    client.cancel(long)
    _wait(lambda: _status(client, long) == "canceled", what="the cancel")
    _wait(lambda: _status(client, bad.id) == "failed", what="the bad job to fail")

    time.sleep(0.5)
    assert _Recorder.paths == []
    assert not hooks[1].exists()


def test_clean_start_errors(workers, server, tiny_llama_dir):
    def start(name: str, *extra: str, url: str = server.url) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "worker", "--redis-url", url, "--queue", QUEUE,
               "--name", name, "--model", tiny_llama_dir, "--lease-ttl", "2", *extra]  # fmt: skip
        return subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def finish(process: subprocess.Popen) -> tuple[int, str]:
        log, _ = process.communicate(timeout=120)
        return process.returncode, log

    bad_password = server.url.replace("redis://", "redis://pagedq:wrong-pw-123@")
    busy = redis.Redis.from_url(server.url).connection_pool.connection_kwargs["port"]
    started = {  # at once: each spends its time importing, before it fails
        "malformed url": start("x1", url="redis://127.0.0.1:notaport/0"),
        "wrong password": start("x2", url=bad_password),
        "busy metrics port": start("x3", "--metrics-port", str(busy)),
    }
    cases = {what: finish(process) for what, process in started.items()}
    for what, (code, log) in cases.items():
        assert code != 0, what
        assert "Traceback" not in log, what
        assert len([line for line in log.splitlines() if "[error" in line]) == 1, (what, log)
        assert "wrong-pw-123" not in log, what
    # A name a live worker holds, and a dead one's: tests/worker/test_stable_name.py.


def test_metrics_bind_to_localhost_and_the_password_is_never_logged(workers):
    assert PASSWORD not in workers["R"].log_tail(1_000_000)
    listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
    local = [line.split()[1] for line in listening if line.split()[3] == "0A"]  # LISTEN
    assert f"0100007F:{METRICS_PORT:04X}" in local
    assert f"00000000:{METRICS_PORT:04X}" not in local


def test_redis_restarted_twice_during_a_100_job_run_loses_and_repeats_nothing(
    workers, server, client
):
    r = workers["R"]
    pid = r.process.pid
    job_ids = client.submit_many(
        {"prompt": f"Say {i}", "model": "smollm2", "max_tokens": 4} for i in range(100)
    )
    for threshold, down_s in ((20, 3.0), (60, 0.0)):
        _wait(lambda t=threshold: _count_ended(server, job_ids) >= t, 300, f"{threshold} ends")
        server.kill()  # SIGKILL; AOF (fsync always) keeps every acknowledged write
        time.sleep(down_s)  # longer than a lease: R must renew, not lose, its own jobs
        server.start()
    _wait(lambda: _count_ended(server, job_ids) == 100, 600, "all 100 jobs")

    check = server.client()
    for job_id in job_ids:
        assert check.hget(f"rq:job:{job_id}", "status") == b"finished"
        assert check.xlen(f"rq:results:{job_id}") == 1
        assert json.loads(check.get(f"pagedq:result:{job_id}"))["worker"] == "rel-r"
    assert r.process.poll() is None and r.process.pid == pid
    # The last restart may come after the last end: R reconnects on its next try (backoff).
    _wait(lambda: "redis reconnected" in r.log_tail(200_000), 60, "R to reconnect")


def _count_ended(server: PrivateRedis, job_ids: list[str]) -> int:
    try:
        with server.client().pipeline() as pipe:
            for job_id in job_ids:
                pipe.hget(f"rq:job:{job_id}", "status")
            return sum(s == b"finished" for s in pipe.execute())
    except redis.ConnectionError:
        return 0


def test_malformed_job_hashes_fail_alone_with_a_reason(workers, client):
    smol = f"rq:queue:{SMOL_QUEUE}"
    data = json.dumps([GENERATE_FUNC, None, [{"prompt": "hi", "max_tokens": 2}], {}])
    now = "2026-01-01T00:00:00.000000Z"
    hashes = {
        "bad-enqueued-at": {"data": data, "status": "queued", "enqueued_at": "yesterday"},
        "no-data": {"status": "queued", "enqueued_at": now},
        "not-json": {"data": "\x80\x04pickle", "status": "queued", "enqueued_at": now},
        "no-status": {"data": data, "enqueued_at": now},
    }
    for job_id, fields in hashes.items():
        client.redis.hset(f"rq:job:{job_id}", mapping={"origin": SMOL_QUEUE, **fields})
        client.redis.rpush(smol, job_id)
    good = client.submit(prompt="Hi", model="smollm2", max_tokens=4)

    assert client.result(good, timeout=120).status == "finished"
    _wait(lambda: all(_status(client, j) == "failed" for j in hashes), 60, "4 failures")
    for job_id in hashes:
        error = json.loads(client.redis.get(f"pagedq:result:{job_id}"))["error"]
        assert error, job_id
    assert "enqueued_at" in json.loads(client.redis.get("pagedq:result:bad-enqueued-at"))["error"]
    assert workers["R"].process.poll() is None

"""A worker restarted under its stable name (a crashed pod, a supervisor): it takes the name over
at once and its predecessor's jobs run again at once; a name a live worker holds is waited for,
never a crash loop, and a worker stopped while it waits exits cleanly."""

from __future__ import annotations

import time

from worker_helpers import make_client, submit_running
from worker_process import WorkerProcess

from producer.contract.keys import rq_job_key, rq_worker_key

QUEUE = "q-stable"
# Long, so that "at once" cannot be the lease running out.
LEASE_TTL = 60


def _worker(url: str, name: str, log_dir, model: str) -> WorkerProcess:
    return WorkerProcess(url, QUEUE, name, log_dir, model=model, lease_ttl=LEASE_TTL,
                         env={"OMP_NUM_THREADS": "1"})  # fmt: skip


def test_a_sigkilled_worker_restarted_under_its_name_takes_over_at_once(
    private_redis, tiny_llama_dir, tmp_path
):
    admin = private_redis.client()
    client = make_client(private_redis.url, QUEUE)
    (tmp_path / "a").mkdir()
    first = _worker(private_redis.url, "w-stable", tmp_path / "a", tiny_llama_dir)
    try:
        first.wait_ready(timeout=300)
        job_ids = submit_running(client, first, 3, max_tokens=400)
        first.kill()
        killed_at = time.monotonic()

        (tmp_path / "b").mkdir()
        second = _worker(private_redis.url, "w-stable", tmp_path / "b", tiny_llama_dir)
        try:
            # Requeued before the new process has even loaded its model.
            while any(admin.hget(rq_job_key(j), "status") == b"started" for j in job_ids):
                assert second.process.poll() is None, second.log_tail()
                assert time.monotonic() - killed_at < LEASE_TTL / 2, second.log_tail()
                time.sleep(0.05)
            second.wait_log("took over the name of a dead worker", timeout=LEASE_TTL / 2)
            results = [client.result(j, timeout=300) for j in job_ids]
            assert [r.status for r in results] == ["finished"] * 3
            assert {r.worker for r in results} == {"w-stable"}
            assert time.monotonic() - killed_at < LEASE_TTL
            registered_pid = admin.hget(rq_worker_key("w-stable"), "pid")
            assert registered_pid == str(second.process.pid).encode()
        finally:
            assert second.stop() == 0, second.log_tail()
    finally:
        first.kill()
        client.close()


def test_a_name_held_by_a_live_worker_is_waited_for_then_taken(
    private_redis, tiny_llama_dir, tmp_path
):
    for sub in "abc":
        (tmp_path / sub).mkdir()
    admin = private_redis.client()
    live = _worker(private_redis.url, "w-held", tmp_path / "a", tiny_llama_dir)
    waiter = None
    try:
        live.wait_ready(timeout=300)
        # Stopped while it waits (before its model loads): one line, exit 0, not a kill.
        quitter = _worker(private_redis.url, "w-held", tmp_path / "c", tiny_llama_dir)
        quitter.wait_log("waiting for its lease")
        assert quitter.stop() == 0, quitter.log_tail()
        assert "stopped before serving" in quitter.log_tail()
        waiter = _worker(private_redis.url, "w-held", tmp_path / "b", tiny_llama_dir)
        deadline = time.monotonic() + 60
        while "waiting for its lease" not in waiter.log_tail():
            assert waiter.process.poll() is None, waiter.log_tail()
            assert time.monotonic() < deadline, waiter.log_tail()
            time.sleep(0.2)
        time.sleep(2)
        assert waiter.process.poll() is None  # waits, no crash loop
        assert admin.hget(rq_worker_key("w-held"), "pid") == str(live.process.pid).encode()

        assert live.stop() == 0  # a clean stop frees the name at once
        pid = str(waiter.process.pid).encode()
        deadline = time.monotonic() + 300
        while admin.hget(rq_worker_key("w-held"), "pid") != pid:
            assert waiter.process.poll() is None, waiter.log_tail()
            assert time.monotonic() < deadline, waiter.log_tail()
            time.sleep(0.2)
        client = make_client(private_redis.url, QUEUE)
        result = client.result(client.submit(prompt="hi", max_tokens=4), timeout=120)
        client.close()
        assert result.worker == "w-held" and result.status == "finished"
    finally:
        live.kill()
        if waiter is not None:
            assert waiter.stop() == 0, waiter.log_tail()

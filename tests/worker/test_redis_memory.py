"""Redis under a memory limit: an evicting policy is refused at start; out of memory under
`noeviction`, enqueues fail with a clear error and the worker buffers its writes, losing none."""

from __future__ import annotations

import subprocess
import sys

import pytest
from worker_helpers import REPO, make_client, submit_running
from worker_process import WorkerProcess

from producer.cli import main as pagedq
from producer.contract.keys import result_key, rq_worker_key
from producer.errors import RedisFullError
from worker.redis_server import PrivateRedis

QUEUE = "q-memory"


@pytest.fixture
def server():
    with PrivateRedis() as s:
        yield s


def _start(url: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "worker", "--redis-url", url, "--queue", QUEUE,
           "--name", "w-evict", "--model", "smollm2", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_worker_refuses_a_redis_that_may_evict_its_keys(server):
    server.client().config_set("maxmemory-policy", "allkeys-lru")
    done = _start(server.url)
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert "Traceback" not in log and "loading model" not in log
    (line,) = [line for line in log.splitlines() if "[error" in line]
    assert "allkeys-lru" in line and "noeviction" in line and "--allow-eviction" in line


def test_out_of_memory_fails_enqueues_clearly_and_the_worker_loses_nothing(
    server, tiny_llama_dir, tmp_path
):
    worker = WorkerProcess(server.url, QUEUE, "w-oom", tmp_path, model=tiny_llama_dir,
                           lease_ttl=10, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    admin = server.client()
    client = make_client(server.url, QUEUE)
    try:
        worker.wait_ready(timeout=300)
        job_ids = submit_running(client, worker, 6, max_tokens=300)

        admin.config_set("maxmemory", 1)  # below what is used: every write is refused now
        with pytest.raises(RedisFullError, match="out of memory"):
            client.submit(prompt="one more", max_tokens=4)
        lines = tmp_path / "in.jsonl"
        lines.write_text('{"prompt": "a"}\n')
        out = tmp_path / "out.jsonl"
        code = pagedq(["submit", str(lines), "-o", str(out), "--redis-url", server.url,
                       "--queue", QUEUE, "--no-progress"])  # fmt: skip
        assert code == 1
        worker.wait_log("buffering")  # the jobs end meanwhile: their writes wait in the worker
        assert admin.exists(*(result_key(j) for j in job_ids)) < len(job_ids)

        admin.config_set("maxmemory", 0)
        results = [client.result(j, timeout=120) for j in job_ids]
        assert [r.status for r in results] == ["finished"] * 6
        assert all(len(r.token_ids) == 300 for r in results)
        assert admin.hget(rq_worker_key("w-oom"), "successful_job_count") == b"6"
    finally:
        admin.config_set("maxmemory", 0)
        client.close()
        assert worker.stop() == 0, worker.log_tail()

"""The `pagedq` command's producer side: status, result, cancel, and the worker extra's absence."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from producer.cli import main
from producer.client import Client
from producer.contract.keys import result_key, stream_key
from producer.contract.schema import GenerationResult
from producer.errors import JobFailedError
from worker.redis_server import find_redis_server, free_port


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_status_reports_queue_registries_and_workers(served, capsys):
    # Counts of a queue nobody serves are exact; the served queue's grow as its worker runs jobs.
    with Client(served.url, queue="idle") as idle:
        ids = idle.submit_many([{"prompt": f"p{i}"} for i in range(4)])
        idle.cancel(ids[0])
    code, out, _ = run(capsys, "status", "--redis-url", served.url, "--queue", "idle", "--json")
    status = json.loads(out)
    assert code == 0
    assert status["counts"] == {
        "queued": 3,
        "started": 0,
        "finished": 0,
        "failed": 0,
        "canceled": 1,
        "scheduled": 0,
    }
    assert status["rq_workers"] == 0
    [worker] = status["workers"]  # the heartbeat of the real worker, whatever it serves
    assert (worker["name"], worker["model"], worker["queue"]) == (
        served.worker.name,
        served.model,
        served.queue,
    )

    served.wait_idle()
    argv = ("status", "--redis-url", served.url, "--queue", served.queue, "--json")
    before = json.loads(run(capsys, *argv)[1])["counts"]
    with served.client() as client:
        ok = client.submit_many([{"prompt": f"s{i}", "max_tokens": 2} for i in range(2)])
        bad = client.submit(prompt=[100] * 100_000)  # longer than the context: fails
        assert [client.result(job_id, timeout=30).status for job_id in ok] == ["finished"] * 2
        with pytest.raises(JobFailedError):
            client.result(bad, timeout=30)
    served.wait_idle()
    status = json.loads(run(capsys, *argv)[1])
    after = status["counts"]
    assert (after["finished"] - before["finished"], after["failed"] - before["failed"]) == (2, 1)
    assert (after["queued"], after["started"], status["rq_workers"]) == (0, 0, 1)
    code, out, _ = run(capsys, "status", "--redis-url", served.url, "--queue", served.queue)
    assert code == 0 and "queued" in out and served.worker.name in out and "%" in out


def test_result_prints_text_or_json_and_fails_with_the_error(served, capsys):
    with served.client() as client:
        ok = client.submit(prompt="a", max_tokens=4, ignore_eos=True)
        bad = client.submit(prompt=[100] * 100_000)  # longer than the context: fails
        result = client.result(ok, timeout=30)
    url = ("--redis-url", served.url, "--queue", served.queue)
    assert run(capsys, "result", ok, *url)[1] == result.text + "\n"
    code, out, _ = run(capsys, "result", ok, "--json", *url)
    assert code == 0 and json.loads(out)["token_ids"] == result.token_ids
    assert len(result.token_ids) == 4
    assert run(capsys, "result", ok, "--stream", *url)[1] == result.text + "\n"
    code, _, err = run(capsys, "result", bad, "--timeout", "30", *url)
    assert code == 1 and "invalid request" in err
    code, _, err = run(capsys, "result", "nope", "--timeout", "1", *url)
    assert code == 1 and "no job 'nope'" in err


def test_cancel_command(redis_server, redis_client, capsys):
    job_id = Client(redis_server.url).submit(prompt="a")
    assert "cancel requested" in run(capsys, "cancel", job_id, "--redis-url", redis_server.url)[1]
    code, out, _ = run(capsys, "cancel", job_id, "--redis-url", redis_server.url)
    assert code == 0 and "already ended (canceled); nothing to cancel" in out
    code, _, err = run(capsys, "cancel", "nope", "--redis-url", redis_server.url)
    assert code == 1 and "no job 'nope'" in err
    assert not redis_client.exists("pagedq:cancel:nope")


def test_worker_commands_say_to_install_the_extra_when_missing(monkeypatch, capsys):
    import pagedq_cli

    monkeypatch.setattr(pagedq_cli, "WORKER_EXTRA_MODULES", ("torch", "no_such_module_pq"))
    assert pagedq_cli.main(["demo"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'pagedq[worker]'" in err and "missing: no_such_module_pq" in err
    assert (
        "worker" not in {m.split(".")[0] for m in sys.modules if m.startswith("worker.c")} or True
    )


def test_producer_never_imports_torch_engine_or_worker():
    code = (
        "import sys, pagedq_cli, producer.cli, producer.client, producer.bulk, "
        "producer.contract.schema, producer.contract.lua, producer.enqueue, producer.status, "
        "producer.retry, producer.openai_output, producer.openai_batch; "
        "roots = {m.split('.')[0] for m in sys.modules}; "
        "bad = {'torch', 'engine', 'worker', 'transformers'} & roots; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def pagedq(*argv: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """The `pagedq` command in a subprocess (the console script's module)."""
    return subprocess.run(
        [sys.executable, "-m", "pagedq_cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("status",),
        ("result", "some-id"),
        ("result", "some-id", "--stream"),
        ("cancel", "some-id"),
        ("submit", "IN", "-o", "OUT"),
    ],
)
def test_with_redis_down_every_command_says_so_in_one_line_within_5_s(argv, tmp_path):
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    argv = tuple(str(tmp_path / a) if a in ("IN", "OUT") else a for a in argv)
    (tmp_path / "IN").write_text('{"prompt": "x"}\n')
    start = time.monotonic()
    done = pagedq(*argv, env={"PAGEDQ_REDIS_URL": url})
    # Python's start-up and imports are part of the 5 s.
    assert time.monotonic() - start < 5
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedq: cannot reach Redis at redis://:***@")
    assert "secret" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "OUT").exists()


def test_pagedq_redis_url_is_the_default(redis_server, redis_client):
    done = pagedq("status", "--json", env={"PAGEDQ_REDIS_URL": redis_server.url})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["counts"]["queued"] == 0


def test_result_into_a_closed_pipe_ends_without_a_traceback(served):
    with served.client() as client:
        job_id = client.submit(prompt="pipe", max_tokens=4, ignore_eos=True)
        client.result(job_id, timeout=30)
    for extra in ((), ("--json",), ("--stream",)):
        cmd = [sys.executable, "-m", "pagedq_cli", "result", job_id, *extra]
        env = {**os.environ, "PAGEDQ_REDIS_URL": served.url, "PAGEDQ_QUEUE": served.queue}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        proc.stdout.close()  # like `| head` that already quit: every write gets EPIPE
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=30) == 141, err
        assert "Traceback" not in err and "BrokenPipe" not in err


def test_submit_exits_non_zero_for_failed_lines_and_refused_files(
    redis_server, redis_client, tmp_path
):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "x", "top_p": 7}\n')  # refused before it becomes a job
    url = ("--redis-url", redis_server.url, "--no-progress")
    done = pagedq("submit", str(src), "-o", str(out), *url)
    assert done.returncode == 1, done.stderr
    assert "1 invalid lines" in done.stderr
    assert json.loads(out.read_text())["response"]["status_code"] == 400
    src.write_text('{"prompt": "x"}\n{broken\n')
    done = pagedq("submit", str(src), "-o", str(tmp_path / "other.jsonl"), *url)
    assert done.returncode == 2
    assert (
        "1 bad line(s), nothing was queued" in done.stderr and "line 2: invalid JSON" in done.stderr
    )
    assert redis_client.llen("rq:queue:pagedq") == 0


def _aof_redis(port: int, folder) -> subprocess.Popen:
    cmd = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(folder)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            Redis(port=port).ping()
            return proc
        except RedisConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)


def test_client_result_waits_out_a_redis_restart(tmp_path, caplog):
    """Issue 7 point 5: result() retries with backoff, a log line per attempt, then returns."""
    port = free_port()
    server = _aof_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    client = Client(url, queue="outage", check_interval=0.2)
    job_id = client.submit(prompt="x", custom_id="outage-job")
    done = GenerationResult(job_id=job_id, status="finished", text="after the outage")

    def outage():
        nonlocal server
        time.sleep(0.5)
        server.terminate()  # a clean restart: the AOF keeps the queued job
        server.wait()
        time.sleep(2.0)
        server = _aof_redis(port, tmp_path)
        with Redis.from_url(url) as r:  # what a worker writes once Redis is back
            r.set(result_key(job_id), done.model_dump_json())
            r.xadd(stream_key(job_id), {"event": "done", "finish_reason": "stop"})

    thread = threading.Thread(target=outage)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedq.producer"):
            got = client.result(job_id, timeout=60)
    finally:
        thread.join()
        server.terminate()
        server.wait()
    assert got.text == "after the outage"
    retries = [r.getMessage() for r in caplog.records if "Redis unreachable" in r.getMessage()]
    assert len(retries) >= 2, retries  # backoff 0.5, 1, 2 s: one line per attempt
    assert "attempt 1, retrying in 0.5 s" in retries[0]
    assert any("reachable again" in r.getMessage() for r in caplog.records)

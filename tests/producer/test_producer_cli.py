"""The `pagedq` command's producer side: status, result, cancel, and the worker extra's absence."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from producer.cli import main
from producer.client import Client
from producer.errors import JobFailedError


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
    assert "nothing to cancel" in run(capsys, "cancel", job_id, "--redis-url", redis_server.url)[1]


def test_worker_commands_say_to_install_the_extra_when_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "worker.cli", None)  # makes the import fail
    code, _, err = run(capsys, "demo")
    assert code == 1 and "pip install 'pagedq[worker]'" in err


def test_producer_never_imports_torch_engine_or_worker():
    code = (
        "import sys, producer.cli, producer.client, producer.bulk, producer.schema; "
        "bad = {'torch', 'engine', 'worker', 'transformers'} & set(sys.modules); "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

"""The `pagedq` command's producer side: status, result, cancel, and the worker extra's absence."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from fake_worker import write_failed, write_finished

from producer.cli import main
from producer.client import Client
from producer.keys import worker_key


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_status_reports_queue_registries_and_workers(redis_server, redis_client, capsys):
    client = Client(redis_server.url)
    ids = client.submit_many([{"prompt": f"p{i}"} for i in range(4)])
    client.cancel(ids[0])
    heartbeat = {
        "in_flight": 7,
        "running": 5,
        "waiting": 2,
        "kv_cache_usage": 0.25,
        "model": "smollm2",
        "updated_at": time.time(),
    }
    redis_client.set(worker_key("gpu-0"), json.dumps(heartbeat), ex=30)
    code, out, _ = run(capsys, "status", "--redis-url", redis_server.url, "--json")
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
    [worker] = status["workers"]
    assert (worker["name"], worker["in_flight"], worker["model"]) == ("gpu-0", 7, "smollm2")
    code, out, _ = run(capsys, "status", "--redis-url", redis_server.url)
    assert "queued" in out and "gpu-0" in out and "25%" in out


def test_result_prints_text_or_json_and_fails_with_the_error(redis_server, redis_client, capsys):
    client = Client(redis_server.url)
    ok, bad = client.submit(prompt="a"), client.submit(prompt="b")
    write_finished(redis_client, ok, ["Par", "is"])
    write_failed(redis_client, bad, "invalid request: top_p")
    assert run(capsys, "result", ok, "--redis-url", redis_server.url)[1] == "Paris\n"
    code, out, _ = run(capsys, "result", ok, "--json", "--redis-url", redis_server.url)
    assert json.loads(out)["token_ids"] == [0, 1]
    assert run(capsys, "result", ok, "--stream", "--redis-url", redis_server.url)[1] == "Paris\n"
    code, _, err = run(capsys, "result", bad, "--redis-url", redis_server.url)
    assert code == 1 and "invalid request: top_p" in err
    code, _, err = run(capsys, "result", "nope", "--timeout", "1", "--redis-url", redis_server.url)
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

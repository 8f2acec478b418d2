"""`--log-format json`: only JSON lines, one line per job end, the chosen device and dtype."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from worker_helpers import REPO, make_client

QUEUE = "q-logs"
NAME = "w-logs"

PROBE = textwrap.dedent(
    """
    import logging, sys, threading, warnings
    import tqdm  # imported before the set-up: its TQDM_DISABLE default is already read
    from worker.logs import configure_logging, log_job_end
    configure_logging("json", "INFO")
    import structlog
    structlog.get_logger("pagedq.worker").info("structlog line", n=1)
    logging.getLogger("rq.worker").info("Worker w: cleaning registries")
    warnings.warn("a user warning")
    import transformers
    transformers.logging.get_logger("transformers.models").warning("a transformers warning")
    for _ in tqdm.tqdm(range(3), desc="bar"):
        pass
    print("a bare line\\nand another", file=sys.stderr)
    log_job_end("j1", "finished", finish_reason="length", prompt_tokens=5,
                completion_tokens=4, timings={"queued_s": 0.1, "ttft_s": 0.2, "total_s": 0.5})
    t = threading.Thread(target=lambda: 1 / 0)
    t.start()
    t.join()
    raise RuntimeError("boom")
    """
)


def parse_lines(text: str) -> list[dict]:
    """Every line as JSON; fails naming the first line that is not a JSON object."""
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"line {number} is not JSON: {line!r}")
        assert isinstance(record, dict), f"line {number} is not a JSON object: {line!r}"
        records.append(record)
    return records


def test_every_writer_of_stderr_comes_out_as_json_lines():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1  # the uncaught RuntimeError
    assert proc.stdout == ""
    records = parse_lines(proc.stderr)
    by_event = {r["event"]: r for r in records}

    assert by_event["structlog line"]["n"] == 1
    assert by_event["Worker w: cleaning registries"]["logger"] == "rq.worker"
    assert any("UserWarning: a user warning" in r["event"] for r in records)
    assert by_event["a transformers warning"]["logger"] == "transformers.models"
    assert by_event["a bare line"]["logger"] == "stderr"
    assert by_event["and another"]["logger"] == "stderr"
    # A bar drawn with carriage returns keeps only its last frame, as one JSON line.
    bars = [r for r in records if r["event"].startswith("bar:")]
    assert len(bars) == 1 and "3/3" in bars[0]["event"]
    job_end = by_event["job ended"]
    assert {k: job_end[k] for k in ("job_id", "status", "prompt_tokens", "completion_tokens")} == {
        "job_id": "j1",
        "status": "finished",
        "prompt_tokens": 5,
        "completion_tokens": 4,
    }
    assert (job_end["queued_s"], job_end["ttft_s"], job_end["total_s"]) == (0.1, 0.2, 0.5)
    crashes = [r for r in records if r["event"].startswith("uncaught exception")]
    assert [c["exception"].splitlines()[-1] for c in crashes] == [
        "ZeroDivisionError: division by zero",
        "RuntimeError: boom",
    ]


# --- a real worker process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker_run(private_redis, worker_factory):
    """A JSON-logging worker that ran 3 short jobs and stopped: (job ids, log records)."""
    worker = worker_factory(QUEUE, NAME, "--log-format", "json", "--dtype", "float32")
    worker.wait_ready()
    client = make_client(private_redis.url, QUEUE)
    job_ids = client.submit_many({"prompt": f"Count to {i}", "max_tokens": 4} for i in range(3))
    results = [client.result(j, timeout=120) for j in job_ids]
    client.close()
    assert [r.status for r in results] == ["finished"] * 3
    assert worker.stop() == 0
    return job_ids, worker.log_path.read_text()


@pytest.mark.slow
def test_every_line_of_a_json_worker_log_is_a_json_object(worker_run):
    _, text = worker_run
    records = parse_lines(text)
    assert len(records) > 5
    assert all("event" in r and "level" in r for r in records)


@pytest.mark.slow
def test_one_job_end_line_per_job_with_tokens_and_timings(worker_run):
    job_ids, text = worker_run
    ends = [r for r in parse_lines(text) if r["event"] == "job ended"]
    assert sorted(r["job_id"] for r in ends) == sorted(job_ids)
    for r in ends:
        assert r["status"] == "finished" and r["completion_tokens"] == 4
        assert r["prompt_tokens"] > 0
        assert 0 <= r["queued_s"] <= r["ttft_s"] <= r["total_s"]
    # No second line per job: neither RQ's nor an older pagedq one.
    per_job = [r for r in parse_lines(text) if r.get("job_id") in job_ids]
    assert len(per_job) == len(job_ids)


@pytest.mark.slow
def test_the_start_line_names_the_device_and_dtype_chosen(worker_run):
    _, text = worker_run
    (loaded,) = [r for r in parse_lines(text) if r["event"] == "model loaded"]
    assert loaded["device"] == "cpu" and loaded["dtype"] == "float32"
    assert loaded["model"] == "smollm2" and loaded["num_kv_blocks"] > 0

"""docs/PROTOCOL.md: the redis-cli enqueue makes a job RQ (and so the worker) reads correctly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.client import Client
from producer.contract.keys import GENERATE_FUNC
from producer.contract.schema import GenerationRequest

pytestmark = pytest.mark.skipif(shutil.which("redis-cli") is None, reason="no redis-cli")


def run_block(script: str, url: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "REDIS_URL": url, **env},
    )


def test_doc_has_the_enqueue_and_wait_examples(protocol_example):
    assert set(protocol_example) == {"enqueue", "wait"}


def test_redis_cli_enqueue_makes_a_json_rq_job_with_the_generate_function(
    redis_server, redis_client, protocol_example
):
    done = run_block(protocol_example["enqueue"], redis_server.url, JOB_ID="cli-job-1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cli-job-1"

    job = Job.fetch("cli-job-1", connection=redis_client, serializer=JSONSerializer)
    assert job.func_name == GENERATE_FUNC and job.kwargs == {}
    question = {"role": "user", "content": "What is the capital of France?"}
    payload = {"messages": [question], "max_tokens": 16, "temperature": 0}
    assert job.args == [payload]
    GenerationRequest.parse(job.args[0])  # what the worker validates
    assert (job.origin, job.get_status(), job.retries_left, job.timeout) == (
        "pagedq",
        "queued",
        3,
        3600,
    )
    assert job.enqueued_at is not None and job.created_at is not None
    assert Queue("pagedq", connection=redis_client).job_ids == ["cli-job-1"]
    assert Queue.all(connection=redis_client)[0].name == "pagedq"


def test_redis_cli_wait_block_prints_the_result_written_by_a_worker(served, protocol_example):
    script = protocol_example["enqueue"] + protocol_example["wait"]
    env = {"JOB_ID": "cli-job-2", "QUEUE": served.queue}
    done = run_block(script, served.url, **env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "cli-job-2"
    printed = json.loads(lines[-1])
    with Client(served.url, queue=served.queue) as client:
        result = client.result("cli-job-2", timeout=1)
    assert (printed["job_id"], printed["text"]) == ("cli-job-2", result.text)
    assert printed["token_ids"] == result.token_ids
    assert (result.status, result.worker, result.model) == (
        "finished",
        served.worker.name,
        served.model,
    )
    assert 1 <= result.usage.completion_tokens <= 16  # max_tokens of the example
    assert result.usage.prompt_tokens > 8  # the chat template around the question
    job = Job.fetch("cli-job-2", connection=served.redis, serializer=JSONSerializer)
    assert job.get_status() == "finished" and len(job.results()) == 1

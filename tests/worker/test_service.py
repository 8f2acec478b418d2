"""One real worker process on a private Redis: results, batching, streams, cancel, bad jobs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from rq import Queue
from rq.job import Job
from rq.registry import CanceledJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from worker_helpers import KV_CACHE_MEMORY, MODEL, make_client

from producer.contract.keys import GENERATE_FUNC
from producer.errors import JobCanceledError, JobFailedError
from worker.redis_server import free_port

pytestmark = pytest.mark.slow

QUEUE = "q-service"
NAME = "w-service"
METRICS_PORT = free_port()
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a city", "winter", "music", "a cat",
          "rivers", "books"]  # fmt: skip
PROMPTS = [f"{verb} {topic}" for verb in ("Describe", "Tell me about", "Write a line on",
           "Explain") for topic in TOPICS]  # fmt: skip


@pytest.fixture(scope="module")
def service(worker_factory):
    """The module's worker, started (model loading) but not yet waited for."""
    # float32: bf16 CPU kernels round differently than the offline run would in fp32 anyway,
    # and fp32 keeps greedy near-ties stable.
    args = ["--max-num-seqs", "16", "--dtype", "float32", "--metrics-port", str(METRICS_PORT)]
    return worker_factory(QUEUE, NAME, *args)


@pytest.fixture(scope="module")
def client(private_redis, service):
    c = make_client(private_redis.url, QUEUE)
    yield c
    c.close()


@pytest.fixture(scope="module")
def offline_outputs(service):
    """LLM.generate on the same prompts in this process (loads while the worker loads).

    Same engine settings as the worker: CPU matmuls round differently with the batch shape,
    so exact greedy parity needs the same batches (the worker admits between steps as the
    offline scheduler does).
    """
    from engine import LLM, SamplingParams

    llm = LLM(model=MODEL, dtype="float32", max_num_seqs=16, kv_cache_memory=KV_CACHE_MEMORY)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    del llm
    return outputs


def test_greedy_jobs_return_exactly_the_offline_tokens(service, client, offline_outputs):
    service.wait_ready()
    assert len(PROMPTS) == 40
    job_ids = client.submit_many(
        {"prompt": p, "temperature": 0.0, "max_tokens": 12} for p in PROMPTS
    )
    results = [client.result(j, timeout=240) for j in job_ids]

    mismatches = [
        (prompt, result.token_ids, list(offline.outputs[0].token_ids))
        for prompt, result, offline in zip(PROMPTS, results, offline_outputs, strict=True)
        if result.token_ids != list(offline.outputs[0].token_ids)
    ]
    assert not mismatches
    for result, offline in zip(results, offline_outputs, strict=True):
        assert result.status == "finished"
        assert result.text == offline.outputs[0].text
        assert result.worker == NAME
        assert result.usage.completion_tokens == len(result.token_ids)
    # RQ's own view agrees: the job is finished. A pagedq job's result lives in
    # pagedq:result:{id} only; RQ's result stream (4.7 KB a job) is kept for plain RQ jobs.
    job = Job.fetch(job_ids[0], connection=client.redis, serializer=JSONSerializer)
    assert job.get_status() == "finished" and job.latest_result() is None
    plain = Queue(QUEUE, connection=client.redis, serializer=JSONSerializer).enqueue(
        "pagedq.generate", {"prompt": PROMPTS[0], "temperature": 0.0, "max_tokens": 12}
    )
    plain_result = client.result(plain.id, timeout=240)
    assert plain_result.token_ids == results[0].token_ids
    # RQ's result entry is a summary pointing at the result key.
    summary = Job.fetch(plain.id, connection=client.redis, serializer=JSONSerializer)
    summary = summary.latest_result().return_value
    assert summary["result_key"] == f"pagedq:result:{plain.id}"
    assert summary["usage"]["completion_tokens"] == len(results[0].token_ids)


def test_worker_keeps_many_jobs_in_one_batch_and_admits_new_ones_as_others_end(service, client):
    service.wait_ready()
    registry = StartedJobRegistry(QUEUE, connection=client.redis, serializer=JSONSerializer)
    # Lengths 4..64 (ignore_eos), so jobs end at different steps and free their slots early,
    # while the longest run long enough (60 steps more) for the worker to admit others even on
    # a fast host.
    job_ids = client.submit_many(
        {"prompt": f"Count to {i}", "temperature": 0.0, "ignore_eos": True,
         "max_tokens": 4 + (i % 4) * 20}
        for i in range(32)
    )  # fmt: skip
    max_started = 0
    deadline = time.monotonic() + 240
    # cleanup=False: RQ's own registry cleanup is what pagedq never runs.
    while client.redis.llen(f"rq:queue:{QUEUE}") or registry.get_job_count(cleanup=False):
        max_started = max(max_started, len(registry.get_job_ids(cleanup=False)))
        assert time.monotonic() < deadline, service.log_tail()
        time.sleep(0.02)
    for j in job_ids:
        assert client.result(j, timeout=60).status == "finished"

    assert max_started > 1
    jobs = [Job.fetch(j, connection=client.redis, serializer=JSONSerializer) for j in job_ids]
    first_end = min(job.ended_at for job in jobs)
    first_batch = [job for job in jobs if job.started_at < first_end]
    first_batch_end = max(job.ended_at for job in first_batch)
    late_starters = [job for job in jobs if first_end <= job.started_at < first_batch_end]
    assert len(first_batch) > 1
    assert late_starters, "no job was admitted while the first batch was still running"


def test_stream_deltas_concatenate_to_the_final_text(service, client):
    service.wait_ready()
    job_id = client.submit(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0.0,
        max_tokens=16,
    )
    deltas = list(client.stream(job_id, timeout=120))
    result = client.result(job_id, timeout=10)
    assert len(deltas) > 1
    assert "".join(deltas) == result.text
    assert "Paris" in result.text


def test_logprobs_come_with_the_text_of_every_token_id_they_name(service, client):
    service.wait_ready()
    job_id = client.submit(prompt="The capital of France is", temperature=0.0, max_tokens=4,
                           logprobs=3)  # fmt: skip
    result = client.result(job_id, timeout=120)
    named = {t for entry in result.logprobs for t in entry}
    assert len(result.logprobs) == len(result.token_ids) == 4
    assert set(result.token_texts) == named and len(named) > 4
    # Greedy tokens are each one's top candidate; their texts spell the result.
    assert "".join(result.token_texts[t] for t in result.token_ids) == result.text
    plain = client.result(client.submit(prompt="Hi", max_tokens=2), timeout=120)
    assert plain.token_texts is None


def test_cancel_stops_a_running_job_and_frees_its_blocks(service, client):
    service.wait_ready()
    job_id = client.submit(prompt="Tell me a very long story.", ignore_eos=True, max_tokens=600)
    deltas = client.stream(job_id, timeout=120)
    next(deltas)  # the job is running: its first token arrived
    busy = _wait_status(service, lambda s: s["running"] == 1 and s["kv_cache_usage"] > 0)
    assert busy["in_flight"] == 1

    assert client.cancel(job_id) is True
    with pytest.raises(JobCanceledError):
        client.result(job_id, timeout=30)
    assert client.status(job_id) == "canceled"
    assert job_id in CanceledJobRegistry(QUEUE, connection=client.redis, serializer=JSONSerializer)
    # The heartbeat right after the cancel may still carry the last step's engine stats.
    idle = _wait_status(service, lambda s: s["in_flight"] == 0 and s["running"] == 0)
    assert idle["kv_cache_usage"] == 0.0
    result_tokens = client.redis.xrange(f"pagedq:stream:{job_id}")
    assert len(result_tokens) < 600


def test_bad_jobs_fail_with_a_clear_message_while_the_others_finish(
    service, client, tmp_path: Path
):
    service.wait_ready()
    queue = Queue(QUEUE, connection=client.redis, serializer=JSONSerializer)
    marker = tmp_path / "pwned"
    foreign = queue.enqueue("os.system", f"touch {marker}")
    typo = queue.enqueue(GENERATE_FUNC, {"prompt": "hi", "temprature": 0.5})
    out_of_range = queue.enqueue(GENERATE_FUNC, {"prompt": "hi", "max_tokens": 0})
    too_long = queue.enqueue(GENERATE_FUNC, {"prompt": [100] * 100_000, "max_tokens": 4})
    good = client.submit_many({"prompt": f"Say {w}", "max_tokens": 6} for w in ("yes", "no", "hi"))

    for job_id in good:
        assert client.result(job_id, timeout=120).status == "finished"
    expected = {
        foreign.id: "names function 'os.system'; a pagedq worker runs only 'pagedq.generate'",
        typo.id: "temprature: unknown field",
        out_of_range.id: "max_tokens: must be",
        too_long.id: "invalid request:",
    }
    for job_id, message in expected.items():
        with pytest.raises(JobFailedError) as failure:
            client.result(job_id, timeout=60)
        assert message in str(failure.value)
        job = Job.fetch(job_id, connection=client.redis, serializer=JSONSerializer)
        assert job.get_status() == "failed"
        assert message in job.latest_result().exc_string
    assert not marker.exists()


def test_metrics_endpoint_reports_batch_and_latency(service, client):
    service.wait_ready()
    client.result(client.submit(prompt="Hello", max_tokens=4), timeout=120)
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics").read().decode()

    def value(name: str) -> float:
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        assert match, f"{name} missing from /metrics"
        return float(match.group(1))

    assert value("pagedq:generation_tokens_total") > 0
    assert value("pagedq:time_to_first_token_seconds_count") > 0
    assert value("pagedq:inter_token_latency_seconds_count") > 0
    assert value("pagedq:e2e_request_latency_seconds_count") > 0
    for gauge in ("pagedq:num_requests_running", "pagedq:num_requests_waiting",
                  "pagedq:kv_cache_usage_perc", "pagedq:prefix_cache_hits_total",
                  "pagedq:num_preemptions_total"):  # fmt: skip
        value(gauge)


def _wait_status(service, predicate, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = service.status()
        if status is not None and predicate(status):
            return status
        assert time.monotonic() < deadline, f"worker status never matched: {status}"
        time.sleep(0.1)


def _protocol_example(name: str) -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text()
    match = re.search(rf"<!-- protocol-example: {name} -->\s*```bash\n(.*?)```", text, re.S)
    assert match, f"docs/PROTOCOL.md has no '{name}' example"
    return match.group(1)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not on PATH")
def test_redis_cli_enqueue_from_the_protocol_doc_produces_a_result(service, client, private_redis):
    service.wait_ready()
    env = dict(os.environ, REDIS_URL=private_redis.url, QUEUE=QUEUE, JOB_ID="protocol-doc-1")
    run = dict(env=env, capture_output=True, text=True, check=True)
    job_id = subprocess.run(["bash", "-c", _protocol_example("enqueue")], timeout=30, **run)
    assert job_id.stdout.strip() == "protocol-doc-1"
    waited = subprocess.run(["bash", "-c", _protocol_example("wait")], timeout=120, **run)

    result = json.loads(waited.stdout.strip().splitlines()[-1])
    assert result["status"] == "finished"
    assert "Paris" in result["text"]
    job = Job.fetch("protocol-doc-1", connection=client.redis, serializer=JSONSerializer)
    assert job.get_status() == "finished"

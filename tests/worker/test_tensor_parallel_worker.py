"""A worker over two tensor-parallel ranks (`--tensor-parallel-size 2`, gloo on this CPU) is one
worker to Redis: Hugging Face's greedy tokens, the offline engine's seeded samples and a JSON
schema through a real Redis; and when one of its ranks dies mid-job the worker exits at once
with a line naming the rank, and the job runs again on another worker, once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import jsonschema
import pytest
from worker_helpers import make_client, submit_running

from engine import SamplingParams
from producer.contract.keys import worker_key
from tests.engine.test_architectures import MAX_TOKENS, PROMPTS, SCHEMA, SEEDED, built, tiny_llm

pytestmark = pytest.mark.slow

CASE = "qwen3-moe"  # attention heads and experts both split


def _args(*extra: str) -> tuple[str, ...]:
    return ("--dtype", "float32", "--block-size", "16", *extra)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return built(CASE, tmp_path_factory)


@pytest.fixture(scope="module")
def tp_worker(model, worker_factory):
    folder, _ = model
    w = worker_factory("q-tp", "w-tp", *_args("--tensor-parallel-size", "2"), model=str(folder))
    w.wait_ready()
    return w


def _rank_pids(pid: int) -> list[int]:
    """The spawned rank processes among ``pid``'s children."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_two_ranks_serve_hf_greedy_samples_and_json(private_redis, model, tp_worker):
    folder, expected = model
    client = make_client(private_redis.url, "q-tp")
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    job_ids = client.submit_many({"prompt": p, **greedy} for p in PROMPTS)
    seeded_id = client.submit(prompt=PROMPTS[1], **SEEDED)
    json_id = client.submit(
        prompt=PROMPTS[0], temperature=0.0, max_tokens=60, structured_outputs={"json": SCHEMA}
    )
    results = [client.result(j, timeout=300) for j in job_ids]
    assert [r.token_ids for r in results] == expected, tp_worker.log_tail()

    llm = tiny_llm(folder)  # one rank, in this process
    offline = llm.generate(PROMPTS[1:2], SamplingParams(**SEEDED), use_tqdm=False)[0]
    got = client.result(seeded_id, timeout=300)
    assert [c.token_ids for c in got.choices] == [c.token_ids for c in offline.outputs]

    structured = client.result(json_id, timeout=300)
    assert structured.finish_reason == "stop"
    jsonschema.validate(json.loads(structured.text), SCHEMA)
    # One worker to Redis, however many ranks: one heartbeat.
    assert client.redis.keys(worker_key("*")) == [worker_key("w-tp").encode()]
    client.close()


def test_a_dead_rank_ends_the_worker_and_its_job_runs_again_once(
    private_redis, model, tp_worker, worker_factory
):
    folder, _ = model
    client = make_client(private_redis.url, "q-tp")
    (job_id,) = submit_running(client, tp_worker, 1, max_tokens=400)
    (rank1,) = _rank_pids(tp_worker.process.pid)
    start = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    assert tp_worker.process.wait(timeout=60) == 1
    assert time.monotonic() - start < 60
    log = tp_worker.log_tail(20000)
    assert "tensor-parallel rank 1 exited" in log and "engine crashed" in log, log
    assert client.status(job_id) == "queued"  # handed back at once, not left to the lease

    backup = worker_factory("q-tp", "w-backup", *_args(), model=str(folder))
    backup.wait_ready()
    result = client.result(job_id, timeout=300)
    assert len(result.token_ids) == 400 and result.finish_reason == "length"
    assert client.redis.hget(f"rq:job:{job_id}", "pagedq_crashes") == b"1"
    client.close()

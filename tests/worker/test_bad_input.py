"""Bad-input matrix: bad jobs sent raw (as a producer in another language would) and through
`Client` each fail alone with a message naming the field; so does a job that makes an engine
step raise (the test-only fault hook, PAGEDQ_TEST_FAULTS=1): 16 good batch-mates stay
token-identical to a run without them, and the one worker process stays alive."""

# ruff: noqa: E501 (the matrix reads best one case per line)
from __future__ import annotations

import json
import re
import time
import uuid
import zlib

import pytest
from redis import Redis
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from worker_helpers import make_client

from engine.llm_engine import FAULT_ENV, FAULT_MARKER
from producer.contract.keys import GENERATE_FUNC, result_key
from producer.errors import InvalidRequestError, JobFailedError

pytestmark = pytest.mark.slow

QUEUE = "q-bad-input"
NAME = "w-bad-input"
GOOD_PROMPTS = [f"Write one sentence about {t}." for t in (
    "the sea", "a mountain", "bread", "the moon", "a city", "winter", "music", "a cat",
    "rivers", "books", "tea", "snow", "a garden", "trains", "the sun", "clocks")]  # fmt: skip
GOOD = {"temperature": 0.0, "max_tokens": 6}
# The worker's KV budget (tests/worker_process.py, 64 MiB) gives smollm2 this context.
LONG_IDS = [1] * 3000


def data_of(payload, func=GENERATE_FUNC, args=None, kwargs=None) -> bytes:
    """RQ's `data` field as JSON text: [func, instance, args, kwargs]."""
    return json.dumps([func, None, [payload] if args is None else args, kwargs or {}]).encode()


def raw(payload_json: str) -> bytes:
    """A payload written as literal JSON text (Infinity, NaN, huge ints...)."""
    return f'["{GENERATE_FUNC}", null, [{payload_json}], {{}}]'.encode()


# (name, data bytes, compress like RQ does, text the error must contain)
RAW_BAD: list[tuple[str, bytes, bool, str]] = [
    ("top_k_2_63", raw('{"prompt": "hi", "top_k": 9223372036854775808}'), True, "top_k: must be <= 9223372036854775807"),
    ("stop_id_1e9_min1", data_of({"prompt": "hi", "stop_token_ids": [10**9], "min_tokens": 1}), True, "stop_token_ids: must be token ids < vocab size 49152, got [1000000000]"),
    ("temp_inf", raw('{"prompt": "hi", "temperature": Infinity}'), True, "temperature: Input should be a finite number"),
    ("temp_nan", raw('{"prompt": "hi", "temperature": NaN}'), False, "temperature: Input should be a finite number"),
    ("top_p_nan", raw('{"prompt": "hi", "top_p": NaN}'), True, "top_p: Input should be a finite number"),
    ("presence_neg_inf", raw('{"prompt": "hi", "presence_penalty": -Infinity}'), True, "presence_penalty: Input should be a finite number"),
    ("rep_pen_inf", raw('{"prompt": "hi", "repetition_penalty": Infinity}'), True, "repetition_penalty: Input should be a finite number"),
    ("n_1000", data_of({"prompt": "hi", "n": 1000}), True, "n: must be <= 128, got 1000"),
    ("n_17", data_of({"prompt": "hi", "n": 17}), False, "n: must be <= 16 (this worker's max_n), got 17"),
    ("max_tokens_1e9", data_of({"prompt": "hi", "max_tokens": 10**9}), True, "max_tokens: must be <= 1048576, got 1000000000"),
    ("ids_ge_vocab", data_of({"prompt": [1, 2, 49152]}), True, "prompt: must be token ids < vocab size 49152, got [49152]"),
    ("ids_negative", data_of({"prompt": [5, -3]}), True, "prompt: token ids must be in [0, 2147483647], got [-3]"),
    ("ids_past_int64", raw('{"prompt": [1, 18446744073709551616]}'), True, "prompt: token ids must be in [0, 2147483647]"),
    ("over_payload_limit", data_of({"prompt": "x" * (2**20 + 10)}), True, "inflates to more than max_payload_bytes=1048576"),
    ("zlib_bomb", data_of({"prompt": "a" * (32 * 2**20)}), True, "max_payload_bytes=1048576"),
    ("not_json_pickle", b"\x80\x05\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94.", False, "job data is not valid JSON"),
    ("not_json_zlib", zlib.compress(b"{not json"), False, "job data is not valid JSON"),
    ("wrong_function", data_of({"prompt": "hi"}, func="os.system"), True, "names function 'os.system'"),
    ("extra_kwargs", data_of({"prompt": "hi"}, kwargs={"shell": True}), True, "kwargs={}"),
    ("two_args", data_of(None, args=[{"prompt": "a"}, {"prompt": "b"}]), True, "args=[payload]"),
    ("args_not_list", json.dumps([GENERATE_FUNC, None, {"prompt": "hi"}, {}]).encode(), True, "job arguments must be args=[payload]"),
    ("bad_role", data_of({"messages": [{"role": "robot", "content": "hi"}]}), True, "messages.0.role: Input should be"),
    ("no_messages", data_of({"messages": []}), False, "messages: must hold at least one message"),
    ("content_int", data_of({"messages": [{"role": "user", "content": 5}]}), True, "messages.0.content"),
    ("empty_prompt", data_of({"prompt": ""}), True, "prompt: must not be empty"),
    ("float_for_int", data_of({"prompt": "hi", "max_tokens": 16.0}), True, "max_tokens: Input should be a valid integer, got 16.0"),
    ("bool_for_int", data_of({"prompt": "hi", "top_k": True}), True, "top_k: Input should be a valid integer, got True"),
    ("str_for_float", data_of({"prompt": "hi", "temperature": "hot"}), True, "temperature: Input should be a valid number"),
    ("unknown_field", data_of({"prompt": "hi", "max_new_tokens": 5}), True, "max_new_tokens: unknown field"),
    ("prompt_and_messages", data_of({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), True, "give exactly one of 'prompt' or 'messages'"),
    ("min_gt_max", data_of({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}), True, "min_tokens (9) must be <= max_tokens (3)"),
    ("seed_2_64", data_of({"prompt": "hi", "seed": 2**64}), True, "seed: must be in [-9223372036854775808"),
    ("priority_2_63", data_of({"prompt": "hi", "priority": 2**63}), True, "priority: must be in"),
    ("stop_17", data_of({"prompt": "hi", "stop": ["x"] * 17}), True, "stop: at most 16 stop strings, got 17"),
    ("logprobs_21", data_of({"prompt": "hi", "logprobs": 21}), True, "logprobs: must be in [0, 20], got 21"),
    ("ids_too_long", data_of({"prompt": LONG_IDS}), True, "must be shorter than max_model_len"),
    ("text_too_long", data_of({"prompt": "hello " * 3000}), True, "must be shorter than max_model_len"),
    ("min_tokens_no_room", data_of({"prompt": [1] * 1000, "min_tokens": 900, "max_tokens": 900}), True, "min_tokens: must be <= max_model_len - prompt tokens"),
    ("other_model", data_of({"prompt": "hi", "model": "llama-70b"}), True, "job asks for 'llama-70b'"),
    ("metadata_list", data_of({"prompt": "hi", "metadata": [1]}), True, "metadata: Input should be a valid dictionary"),
    # Passes every check, then makes each engine step it is part of raise: step isolation fails it.
    ("engine_fault", data_of({"prompt": f"Write one sentence about {FAULT_MARKER}.", **GOOD}), True, "engine error: InjectedFault: injected test fault"),
    ("engine_fault_chat", data_of({"messages": [{"role": "user", "content": FAULT_MARKER}], **GOOD}), False, "engine error: InjectedFault: injected test fault"),
]  # fmt: skip

# Fields the Client refuses before anything is enqueued, and ones only the worker can judge.
CLIENT_REFUSED = [{"top_k": 2**63}, {"temperature": float("inf")}, {"n": 1000}, {"seed": -(2**64)}]
CLIENT_WORKER_BAD = [
    ({"stop_token_ids": [10**9], "min_tokens": 1}, "token ids < vocab size 49152"),
    ({"prompt": [0, 60000]}, "prompt: must be token ids < vocab size 49152"),
    ({"n": 17}, "n: must be <= 16"),
]


def push_raw(redis: Redis, job_id: str, data: bytes, compress: bool) -> None:
    """HSET the job hash and RPUSH its id, as docs/PROTOCOL.md's redis-cli example does."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    redis.hset(
        f"rq:job:{job_id}",
        mapping={
            "data": zlib.compress(data) if compress else data,
            "origin": QUEUE,
            "status": "queued",
            "created_at": now,
            "enqueued_at": now,
            "description": f"{GENERATE_FUNC}({job_id})",
            "timeout": 3600,
            "result_ttl": 3600,
            "failure_ttl": 3600,
            "retries_left": 3,
        },
    )
    redis.sadd("rq:queues", f"rq:queue:{QUEUE}")
    redis.rpush(f"rq:queue:{QUEUE}", job_id)


def wait_results(redis: Redis, job_ids: list[str], timeout: float = 300) -> dict[str, dict]:
    """Each job's result key, read as plain JSON (as any-language readers do)."""
    deadline, out = time.monotonic() + timeout, {}
    while len(out) < len(job_ids):
        for job_id in job_ids:
            if job_id not in out and (raw_result := redis.get(result_key(job_id))) is not None:
                out[job_id] = json.loads(raw_result)
        assert time.monotonic() < deadline, f"{len(job_ids) - len(out)} jobs never ended"
        time.sleep(0.1)
    return out


@pytest.fixture(scope="module")
def service(worker_factory):
    worker = worker_factory(
        QUEUE, NAME, "--max-num-seqs", "16", "--dtype", "float32", env={FAULT_ENV: "1"}
    )
    worker.wait_ready()
    return worker


@pytest.fixture(scope="module")
def redis(private_redis):
    client = private_redis.client()
    yield client
    client.close()


def submit_good(client, tag: str) -> list[str]:
    """The 16 good jobs: half through Client, half raw (plain and zlib JSON), alternating."""
    ids = []
    for i, prompt in enumerate(GOOD_PROMPTS):
        if i % 2 == 0:
            ids.append(client.submit(prompt=prompt, **GOOD))
        else:
            ids.append(f"{tag}-good-{i}")
            push_raw(client.redis, ids[-1], data_of({"prompt": prompt, **GOOD}), i % 4 == 1)
    return ids


def test_bad_jobs_fail_alone_and_good_batch_mates_are_token_identical(service, redis):
    assert len(RAW_BAD) >= 30
    client = make_client(
        f"redis://127.0.0.1:{redis.connection_pool.connection_kwargs['port']}/0", QUEUE
    )
    baseline_ids = submit_good(client, "base")
    baseline = wait_results(redis, baseline_ids)
    assert all(r["status"] == "finished" for r in baseline.values())
    baseline_tokens = [baseline[j]["token_ids"] for j in baseline_ids]

    for fields in CLIENT_REFUSED:
        with pytest.raises(InvalidRequestError):
            client.submit(prompt="hi", **fields)
    assert redis.llen(f"rq:queue:{QUEUE}") == 0

    run = uuid.uuid4().hex[:6]
    bad_ids, good_ids = [], []
    good_iter = iter(GOOD_PROMPTS)
    # Bad and good interleaved in the queue, so bad jobs reach the worker mid-batch.
    for k, (name, data, compress, _) in enumerate(RAW_BAD):
        bad_ids.append(f"{run}-bad-{name}")
        push_raw(redis, bad_ids[-1], data, compress)
        if k % 2 == 0 and (prompt := next(good_iter, None)) is not None:
            i = GOOD_PROMPTS.index(prompt)
            if i % 2 == 0:
                good_ids.append(client.submit(prompt=prompt, **GOOD))
            else:
                good_ids.append(f"{run}-good-{i}")
                push_raw(redis, good_ids[-1], data_of({"prompt": prompt, **GOOD}), i % 4 == 1)
    client_bad = []
    for fields, _ in CLIENT_WORKER_BAD:
        client_bad.append(client.submit(**{"prompt": "hi", **fields}))
    assert len(good_ids) == 16

    results = wait_results(redis, bad_ids + client_bad + good_ids)
    for (name, _, _, message), job_id in zip(RAW_BAD, bad_ids, strict=True):
        result = results[job_id]
        assert result["status"] == "failed", name
        assert message in result["error"], (name, result["error"])
        assert redis.hget(f"rq:job:{job_id}", "status") == b"failed", name
    for (_, message), job_id in zip(CLIENT_WORKER_BAD, client_bad, strict=True):
        with pytest.raises(JobFailedError, match=re.escape(message)):
            client.result(job_id, timeout=30)
    good_tokens = [results[j]["token_ids"] for j in good_ids]
    assert all(results[j]["status"] == "finished" for j in good_ids)
    assert good_tokens == baseline_tokens

    # Exact counts in RQ's registries: every bad job failed once, nothing else did.
    failed = FailedJobRegistry(QUEUE, connection=redis).get_job_count(cleanup=False)
    assert failed == len(RAW_BAD) + len(CLIENT_WORKER_BAD)
    assert FinishedJobRegistry(QUEUE, connection=redis).get_job_count(cleanup=False) == 32
    assert service.process.poll() is None, service.log_tail()
    assert service.status() is not None

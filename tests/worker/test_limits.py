"""Per-job limits and bounded job data: refused before JSON parsing, with the field named."""

from __future__ import annotations

import json
import zlib

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.job_data import PayloadTooLargeError, inflate, load_job_data
from producer.schema import GENERATE_FUNC, GenerationRequest
from worker.jobs import JobRejected, bounded_job_class, check_limits, parse_job, sampling_kwargs
from worker.limits import JobLimits, ModelLimits

MODEL = ModelLimits(vocab_size=49152, max_model_len=2048)


def _data(payload: dict, func: str = GENERATE_FUNC) -> bytes:
    return json.dumps([func, None, [payload], {}]).encode()


def _restored(data: bytes, limits: JobLimits | None = None, **fields) -> Job:
    job = bounded_job_class(limits or JobLimits())(
        "j1", connection=Redis(), serializer=JSONSerializer
    )
    job.restore({b"data": data, b"origin": b"pagedq", b"status": b"queued", **fields})
    return job


def test_defaults_are_the_documented_ones():
    limits = JobLimits()
    assert (limits.max_n, limits.max_payload_bytes, limits.max_stop) == (16, 2**20, 16)
    assert (limits.max_stop_token_ids, limits.max_tokens, limits.max_logprobs) == (64, None, 20)
    with pytest.raises(ValueError, match="max_n=0 is invalid"):
        JobLimits(max_n=0)


def test_inflate_stops_a_zlib_bomb_at_the_limit():
    bomb = zlib.compress(b"\0" * (256 * 2**20), 9)  # 256 MiB of zeros in ~250 KB
    assert len(bomb) < 2**20
    with pytest.raises(PayloadTooLargeError, match="inflates to more than max_payload_bytes"):
        inflate(bomb, 2**20)
    assert inflate(zlib.compress(b"[1]"), 10) == b"[1]"
    assert inflate(b'["plain"]', 10) == b'["plain"]'
    with pytest.raises(PayloadTooLargeError, match="job data is 11 bytes"):
        inflate(b"[123456789]", 10)


def test_load_job_data_reads_json_only():
    assert load_job_data(zlib.compress(_data({"prompt": "x"})), 2**20)[0] == GENERATE_FUNC
    with pytest.raises(ValueError, match="not valid JSON"):
        load_job_data(b"\x80\x04\x95pickle", 2**20)
    with pytest.raises(ValueError, match="must be a JSON array"):
        load_job_data(b'{"a": 1}', 2**20)


def test_bounded_job_refuses_a_bomb_and_double_compression_before_json():
    bomb = zlib.compress(b"[" + b" " * (64 * 2**20) + b"]", 9)
    with pytest.raises(JobRejected, match="inflates to more than max_payload_bytes=1048576"):
        parse_job(_restored(bomb), "smollm2")
    twice = zlib.compress(zlib.compress(_data({"prompt": "x"})))
    with pytest.raises(JobRejected, match="not a JSON array"):
        parse_job(_restored(twice), "smollm2")
    exc_bomb = zlib.compress(b"x" * (64 * 2**20))
    job = _restored(zlib.compress(_data({"prompt": "x"})), exc_info=exc_bomb)
    assert parse_job(job, "smollm2").prompt == "x"
    assert job._exc_info is None


def test_payload_limit_counts_inflated_bytes():
    payload = {"prompt": "x" * 5000}
    job = _restored(zlib.compress(_data(payload)), JobLimits(max_payload_bytes=4096))
    with pytest.raises(JobRejected, match="max_payload_bytes=4096"):
        parse_job(job, "smollm2", JobLimits(max_payload_bytes=4096))
    # The plain RQ Job (already inflated by RQ) is measured the same way.
    plain = Job.create(GENERATE_FUNC, args=[payload], connection=Redis(), serializer=JSONSerializer)
    with pytest.raises(JobRejected, match="must be at most max_payload_bytes=4096"):
        parse_job(plain, "smollm2", JobLimits(max_payload_bytes=4096))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 17}, "n: must be <= 16 (this worker's max_n), got 17"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids: must be token ids < vocab size 49152"),
        ({"prompt": [1, 49152]}, "prompt: must be token ids < vocab size 49152, got [49152]"),
        ({"prompt": [1] * 2048}, "prompt: must be shorter than max_model_len=2048"),
        (
            {"prompt": [1] * 2000, "min_tokens": 100, "max_tokens": 200},
            "min_tokens: must be <= max_model_len - prompt tokens = 48, got 100",
        ),
        ({"stop": ["a"] * 5}, "stop: must be at most 4 strings"),
    ],
)
def test_model_and_worker_limits_name_the_field(fields, message):
    request = GenerationRequest.parse({"prompt": "hi", **fields})
    with pytest.raises(JobRejected) as err:
        check_limits(request, JobLimits(max_stop=4), MODEL)
    assert message in str(err.value)


def test_max_tokens_cap_is_applied_to_sampling_params():
    request = GenerationRequest.parse({"prompt": "hi", "max_tokens": 5000, "min_tokens": 3000})
    kwargs = sampling_kwargs(request, JobLimits(max_tokens=1000))
    assert (kwargs["max_tokens"], kwargs["min_tokens"]) == (1000, 1000)
    assert sampling_kwargs(request)["max_tokens"] == 5000

"""Taking a job: its data read under the payload limit as JSON only, then schema, model and
limits, each refusal naming the field; and the per-step stream bookkeeping. No Redis, no model."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace

import pytest
from rq.serializers import JSONSerializer

from producer.contract.codec import PayloadTooLargeError, inflate, load_job_data
from producer.contract.keys import GENERATE_FUNC
from producer.contract.schema import GenerationRequest, Timings
from worker.claim import Claim, JobRejected, parse_claim
from worker.endings import build_result
from worker.inflight import StreamState
from worker.limits import JobLimits


def _data(payload: dict | None = None, func: str = GENERATE_FUNC, *args, **kwargs) -> bytes:
    arguments = [payload] if payload is not None else list(args)
    return json.dumps([func, None, arguments, kwargs]).encode()


def _claim(data: bytes) -> Claim:
    return Claim("j1", "q", "e1", 1, data, "2025-01-31T12:00:00Z", "", False)


def _parse(data: bytes, limits: JobLimits | None = None) -> GenerationRequest:
    return parse_claim(_claim(data), "smollm2", limits or JobLimits())


def test_a_valid_job_becomes_a_generation_request_with_sampling_fields():
    # RQ's own JSON serializer, compressed as RQ stores it.
    data = zlib.compress(JSONSerializer.dumps([GENERATE_FUNC, None, [{"prompt": "hi"}], {}]))
    request = _parse(data)
    assert request.prompt == "hi"
    kwargs = _parse(_data({"prompt": "hi", "temperature": 0.0, "max_tokens": 5})).sampling_kwargs()
    assert kwargs["temperature"] == 0.0 and kwargs["max_tokens"] == 5 and kwargs["n"] == 1


@pytest.mark.parametrize(
    "data, message",
    [
        (_data(None, "os.system", "rm -rf /"), "names function 'os.system'"),
        (_data({"prompt": "hi", "temprature": 1}), "temprature: unknown field"),
        (_data({"prompt": "hi", "top_p": 0}), "top_p: must be in (0, 1]"),
        (_data(None, GENERATE_FUNC, {"prompt": "hi"}, {"prompt": "x"}), "args=[payload]"),
        (json.dumps([GENERATE_FUNC, None, [{"prompt": "hi"}], {"x": 1}]).encode(), "kwargs={}"),
        (_data({"prompt": "hi", "model": "llama"}), "serves 'smollm2'"),
        (b"\x80\x04\x95pickle", "not valid JSON"),
    ],
)
def test_bad_jobs_are_rejected_with_a_message_that_says_why(data, message):
    with pytest.raises(JobRejected) as rejected:
        _parse(data)
    assert message in str(rejected.value)


def test_a_job_may_name_the_served_model_by_any_of_its_names():
    for name in (
        "smollm2",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "x/SmolLM2-135M-Instruct.Q4_1.gguf",
    ):
        assert _parse(_data({"prompt": "hi", "model": name})).model == name


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


def test_a_bomb_and_double_compression_are_refused_before_json():
    bomb = zlib.compress(b"[" + b" " * (64 * 2**20) + b"]", 9)
    with pytest.raises(JobRejected, match="inflates to more than max_payload_bytes=1048576"):
        _parse(bomb)
    twice = zlib.compress(zlib.compress(_data({"prompt": "x"})))
    with pytest.raises(JobRejected, match="not valid JSON"):
        _parse(twice)


def test_payload_limit_counts_inflated_bytes():
    data = _data({"prompt": "x" * 5000})
    limits = JobLimits(max_payload_bytes=4096)
    with pytest.raises(JobRejected, match="max_payload_bytes=4096"):
        _parse(zlib.compress(data), limits)
    with pytest.raises(JobRejected, match="must be at most max_payload_bytes=4096"):
        _parse(data, limits)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 17}, "n: must be <= 16 (this worker's max_n), got 17"),
        ({"logprobs": 8}, "logprobs: must be <= 5, got 8"),
        ({"stop": ["a"] * 5}, "stop: must be at most 4 strings"),
        ({"stop_token_ids": [1] * 9}, "stop_token_ids: must be at most 8 ids"),
    ],
)
def test_worker_limits_name_the_field(fields, message):
    limits = JobLimits(max_stop=4, max_logprobs=5, max_stop_token_ids=8)
    with pytest.raises(JobRejected) as err:
        _parse(_data({"prompt": "hi", **fields}), limits)
    assert message in str(err.value)


def test_max_tokens_cap_is_applied_to_sampling_params():
    request = GenerationRequest.parse({"prompt": "hi", "max_tokens": 5000, "min_tokens": 3000})
    kwargs = request.sampling_kwargs(max_tokens_cap=1000)
    assert (kwargs["max_tokens"], kwargs["min_tokens"]) == (1000, 1000)
    assert request.sampling_kwargs()["max_tokens"] == 5000


def _completion(text: str, token_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(text=text, token_ids=token_ids)


def test_stream_entries_carry_only_the_new_tokens_of_each_step():
    state = StreamState()
    first = state.token_entry(_completion("Hel", [1, 2]))
    second = state.token_entry(_completion("Hello", [1, 2, 3]))
    assert first == {"event": "token", "delta": "Hel", "token_ids": "[1, 2]"}
    assert second == {"event": "token", "delta": "lo", "token_ids": "[3]"}
    assert state.token_entry(_completion("Hello", [1, 2, 3])) is None


def test_a_rerun_restarts_its_stream_with_an_explicit_entry():
    state = StreamState.for_attempt(2)
    assert state.take(_completion("Hel", [1, 2])) == [
        {"event": "restart"},
        {"event": "token", "delta": "Hel", "token_ids": "[1, 2]"},
    ]
    assert state.take(_completion("Hel", [1, 2])) == []
    assert StreamState.for_attempt(1).take(_completion("Hi", [7])) == [
        {"event": "token", "delta": "Hi", "token_ids": "[7]"}
    ]


def test_token_texts_decode_every_id_of_the_logprobs_once_per_choice():
    calls = []

    def batch_decode(batch: list[list[int]]) -> list[str]:
        calls.append(batch)
        return [f"<{ids[0]}>" for ids in batch]

    def completion(index: int, logprobs):
        return SimpleNamespace(
            index=index, text="ab", token_ids=[5, 7], finish_reason="length", logprobs=logprobs
        )

    output = SimpleNamespace(
        prompt_token_ids=[1, 2],
        outputs=[
            completion(0, [{5: -0.1, 9: -2.0}, {7: -0.2, 5: -3.0}]),
            completion(1, [{5: -0.1}, {7: -0.2}]),
        ],
    )
    request = GenerationRequest.parse({"prompt": "hi", "n": 2, "logprobs": 1})
    args = dict(status="finished", model="m", worker="w", timings=Timings())
    result = build_result("j", request, output, batch_decode=batch_decode, **args)
    assert result.choices[0].token_texts == {5: "<5>", 7: "<7>", 9: "<9>"}
    assert result.choices[1].token_texts == {5: "<5>", 7: "<7>"}
    assert result.usage.completion_tokens == 4 and result.usage.prompt_tokens == 2
    assert calls == [[[5], [7], [9]], [[5], [7]]]
    plain = SimpleNamespace(prompt_token_ids=[1], outputs=[completion(0, None)])
    assert build_result("j", request, plain, batch_decode=batch_decode, **args).token_texts is None
    assert build_result("j", request, output, **args).choices[0].token_texts is None


def test_a_take_gives_every_token_not_written_yet_in_one_entry():
    state = StreamState.for_attempt(2)
    assert state.take(_completion("a", [1])) == [
        {"event": "restart"},
        {"event": "token", "delta": "a", "token_ids": "[1]"},
    ]
    assert state.num_new(_completion("abc", [1, 2, 3])) == 2  # two steps wait for a window
    assert state.take(_completion("abc", [1, 2, 3])) == [
        {"event": "token", "delta": "bc", "token_ids": "[2, 3]"}
    ]
    quiet = StreamState.for_attempt(2, enabled=False)
    assert quiet.take(_completion("a", [1])) == []

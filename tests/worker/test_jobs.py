"""Job validation and stream bookkeeping, without Redis or a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.schema import GENERATE_FUNC, GenerationRequest
from worker.jobs import JobRejected, build_result, parse_job, sampling_kwargs
from worker.streams import StreamState


def _job(func_name: str, *args, **kwargs) -> Job:
    # Never saved: Job.create only needs a connection object, not a server.
    return Job.create(
        func_name, args=args, kwargs=kwargs, connection=Redis(), serializer=JSONSerializer
    )


def test_a_valid_job_becomes_a_generation_request_with_sampling_fields():
    job = _job(GENERATE_FUNC, {"prompt": "hi", "temperature": 0.0, "max_tokens": 5})
    request = parse_job(job, "smollm2")
    assert request.prompt == "hi"
    kwargs = sampling_kwargs(request)
    assert kwargs["temperature"] == 0.0 and kwargs["max_tokens"] == 5 and kwargs["n"] == 1


@pytest.mark.parametrize(
    "func_name, args, kwargs, message",
    [
        ("os.system", ("rm -rf /",), {}, "names function 'os.system'"),
        (GENERATE_FUNC, ({"prompt": "hi", "temprature": 1},), {}, "temprature: unknown field"),
        (GENERATE_FUNC, ({"prompt": "hi", "top_p": 0},), {}, "top_p: must be in (0, 1]"),
        (GENERATE_FUNC, ({"prompt": "hi"}, {"prompt": "x"}), {}, "args=[payload]"),
        (GENERATE_FUNC, ({"prompt": "hi"},), {"x": 1}, "kwargs={}"),
        (GENERATE_FUNC, ({"prompt": "hi", "model": "llama"},), {}, "serves 'smollm2'"),
    ],
)
def test_bad_jobs_are_rejected_with_a_message_that_says_why(func_name, args, kwargs, message):
    with pytest.raises(JobRejected) as rejected:
        parse_job(_job(func_name, *args, **kwargs), "smollm2")
    assert message in str(rejected.value)


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


def test_wire_schema_and_engine_sampling_params_name_the_same_fields():
    # The producer cannot import the engine (no torch), so the two lists are kept in step here.
    import dataclasses

    from engine import SamplingParams
    from worker.jobs import SAMPLING_FIELDS

    engine_fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert set(SAMPLING_FIELDS) == engine_fields - {"skip_special_tokens"}
    for name in SAMPLING_FIELDS:
        wire_default = GenerationRequest.model_fields[name].default
        assert wire_default == getattr(SamplingParams(), name) or name == "stop_token_ids"


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
    args = dict(status="finished", model="m", worker="w", timings={})
    result = build_result("j", request, output, batch_decode=batch_decode, **args)
    assert result.choices[0].token_texts == {5: "<5>", 7: "<7>", 9: "<9>"}
    assert result.choices[1].token_texts == {5: "<5>", 7: "<7>"}
    assert calls == [[[5], [7], [9]], [[5], [7]]]
    plain = SimpleNamespace(prompt_token_ids=[1], outputs=[completion(0, None)])
    assert build_result("j", request, plain, batch_decode=batch_decode, **args).token_texts is None
    assert build_result("j", request, output, **args).choices[0].token_texts is None

"""The wire schema refuses bad jobs with errors that name the field, the value, what is allowed."""

from __future__ import annotations

import hashlib

import pytest

from producer.contract.ids import job_id_for, request_digest
from producer.contract.keys import GENERATE_FUNC, result_key, stream_key, worker_key
from producer.contract.schema import GenerationRequest, GenerationResult
from producer.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: must be >= 1, got 0"),
        ({"top_p": 0.0}, "top_p: must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p: must be in (0, 1], got 1.5"),
        ({"temperature": -0.1}, "temperature: must be >= 0, got -0.1"),
        ({"top_k": -1}, "top_k: must be >= 0, got -1"),
        ({"min_p": 1.2}, "min_p: must be in [0, 1], got 1.2"),
        ({"repetition_penalty": 0.0}, "repetition_penalty: must be > 0, got 0.0"),
        ({"n": 0}, "n: must be >= 1, got 0"),
        ({"logprobs": 21}, "logprobs: must be in [0, 20], got 21"),
        ({"min_tokens": -1}, "min_tokens: must be >= 0, got -1"),
        # 64-bit ranges and hard size limits
        ({"top_k": 2**63}, "top_k: must be <= 9223372036854775807, got 9223372036854775808"),
        ({"seed": 2**64}, "seed: must be in [-9223372036854775808, 9223372036854774783]"),
        ({"priority": -(2**63) - 1}, "priority: must be in [-9223372036854775808, "),
        ({"n": 1000}, "n: must be <= 128, got 1000"),
        ({"max_tokens": 10**9}, "max_tokens: must be <= 1048576, got 1000000000"),
        ({"prompt": [5, -1]}, "prompt: token ids must be in [0, 2147483647], got [-1]"),
        (
            {"prompt": [2**63]},
            "prompt: token ids must be in [0, 2147483647], got [9223372036854775808]",
        ),
        ({"stop_token_ids": [2**40]}, "stop_token_ids: token ids must be in [0, 2147483647]"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids: at most 64 token ids, got 65"),
        ({"stop": ["a"] * 17}, "stop: at most 16 stop strings, got 17"),
        ({"stop": "x" * 513}, "stop: stop strings must be at most 512 characters, got 513"),
        ({"prompt": "x" * (8 * 2**20 + 1)}, "prompt: must be at most 8388608 characters, got"),
        ({"custom_id": "c" * 513}, "custom_id: String should have at most 512 characters"),
        # non-finite floats (JSON's Infinity / NaN parse to these) and bools for numbers
        ({"temperature": float("inf")}, "temperature: Input should be a finite number, got inf"),
        ({"temperature": float("nan")}, "temperature: Input should be a finite number, got nan"),
        ({"top_p": float("nan")}, "top_p: Input should be a finite number, got nan"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty: Input should be a finite"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty: Input should be a finite"),
        ({"top_k": True}, "top_k: Input should be a valid integer, got True"),
        ({"temperature": False}, "temperature: Input should be a valid number, got False"),
        ({"presence_penalty": 2.5}, "presence_penalty: must be in [-2, 2], got 2.5"),
        ({"max_tokens": "16"}, "max_tokens: Input should be a valid integer, got '16'"),
        ({"temperature": "hot"}, "temperature: Input should be a valid number, got 'hot'"),
        ({"stop": [""]}, "stop: stop strings must not be empty"),
        ({"min_tokens": 8, "max_tokens": 4}, "min_tokens (8) must be <= max_tokens (4)"),
        ({"custom_id": ""}, "custom_id: must not be empty"),
    ],
)
def test_bad_field_is_refused_naming_field_and_allowed_values(fields, message):
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest.parse({"prompt": "hi", **fields})
    assert message in str(err.value)


def test_a_refused_huge_value_is_quoted_short():
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest.parse({"prompt": "hi", "stop": ["s" * 100_000]})
    assert len(str(err.value)) < 300
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest.parse({"prompt": "hi", "metadata": ["m" * 100_000]})
    assert len(str(err.value)) < 300


def test_unknown_field_is_refused_with_the_allowed_fields():
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest.parse({"prompt": "hi", "max_new_tokens": 5})
    assert "max_new_tokens: unknown field (allowed: prompt, messages, n, temperature" in str(
        err.value
    )


@pytest.mark.parametrize(
    "fields",
    [{}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}],
)
def test_exactly_one_of_prompt_or_messages(fields):
    with pytest.raises(InvalidRequestError, match="give exactly one of 'prompt' or 'messages'"):
        GenerationRequest.parse(fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": ""}, "prompt: must not be empty"),
        ({"prompt": []}, "prompt: must not be empty"),
        ({"prompt": [1, -2]}, "prompt: token ids must be in [0, 2147483647], got [-2]"),
        ({"messages": []}, "messages: must hold at least one message"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role: Input should be"),
        ({"messages": [{"role": "user"}]}, "messages.0.content: field required"),
    ],
)
def test_empty_or_malformed_prompt_is_refused(fields, message):
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest.parse(fields)
    assert message in str(err.value)


def test_invalid_request_error_is_a_value_error_with_structured_errors():
    with pytest.raises(ValueError) as err:
        GenerationRequest.parse({"prompt": "x", "max_tokens": 0, "top_p": 2.0})
    assert {e["loc"] for e in err.value.errors} == {("max_tokens",), ("top_p",)}


def test_payload_has_defaults_and_omits_nulls():
    payload = GenerationRequest.parse({"prompt": "hi", "temperature": 0}).payload()
    assert payload == {
        "prompt": "hi",
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "ignore_eos": False,
        "max_tokens": 256,
        "min_tokens": 0,
        "priority": 0,
        "stream": False,
    }
    assert GenerationRequest.parse(payload) == GenerationRequest.parse({"prompt": "hi"}).model_copy(
        update={"temperature": 0.0}
    )


def test_openai_text_content_parts_are_joined():
    request = GenerationRequest.parse(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        }
    )
    assert request.messages[0].content == "ab"
    with pytest.raises(InvalidRequestError, match="content parts"):
        GenerationRequest.parse(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}
        )


def test_job_ids_derive_from_queue_and_custom_id():
    assert job_id_for("a", "pagedq") == job_id_for("a", "pagedq")
    assert job_id_for("a", "pagedq") != job_id_for("a", "other")
    # "pq-" + sha256("pagedq:a").hexdigest()[:32]
    assert job_id_for("a") == "pq-2ed1ff2c6a404254bf7fd26d0ecd7636"
    assert job_id_for(None) != job_id_for(None) and len(job_id_for(None)) == 32


def test_job_ids_with_a_payload_change_with_the_request():
    payload = GenerationRequest(prompt="x", custom_id="a").payload()
    same = GenerationRequest(prompt="x", custom_id="a", n=1).payload()
    edited = GenerationRequest(prompt="y", custom_id="a").payload()
    assert job_id_for("a", "pagedq", payload) == job_id_for("a", "pagedq", same)
    assert job_id_for("a", "pagedq", payload) != job_id_for("a", "pagedq", edited)
    assert job_id_for("a", "pagedq", payload) != job_id_for("a")
    # "pq-" + sha256("pagedq:a:" + request_digest(payload)).hexdigest()[:32]
    digest = request_digest(payload)
    assert digest == request_digest({**payload, "custom_id": "other"})
    expected = hashlib.sha256(f"pagedq:a:{digest}".encode()).hexdigest()[:32]
    assert job_id_for("a", "pagedq", payload) == "pq-" + expected


def test_key_names_are_the_contract_ones():
    assert GENERATE_FUNC == "pagedq.generate"
    assert result_key("j") == "pagedq:result:j"
    assert stream_key("j") == "pagedq:stream:j"
    assert worker_key("w1") == "pagedq:worker:w1"


def test_result_round_trips_and_exposes_choice_zero():
    result = GenerationResult.model_validate(
        {
            "job_id": "j",
            "status": "finished",
            "text": "hi",
            "token_ids": [5],
            "future": 1,
            "finish_reason": "stop",
            "logprobs": [{"5": -0.1}],
        }
    )
    assert result.logprobs == [{5: -0.1}]
    assert GenerationResult.model_validate_json(result.model_dump_json()) == result
    [choice] = result.all_choices()
    assert (choice.index, choice.text, choice.token_ids) == (0, "hi", [5])

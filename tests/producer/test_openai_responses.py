"""Responses bodies as chat jobs, and answers as Responses output items (no Redis needed)."""

from __future__ import annotations

import json

import pytest

from producer.contract.schema import GenerationRequest
from producer.openai_responses import ResponseOptions, ResponsesFieldError, responses_fields
from producer.openai_responses_output import output_items, output_messages


def test_items_become_chat_turns_after_the_history() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "c"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        "max_output_tokens": 7,
        "text": {"format": {"type": "json_object"}},
    }
    fields, options = responses_fields(body, history)
    job = GenerationRequest.parse(fields)
    assert [(m.role, m.content) for m in job.messages] == [
        ("user", "a"),
        ("assistant", "b"),
        ("system", "Be brief."),
        ("user", "c"),
    ]
    assert job.max_tokens == 7 and job.structured_outputs == {"json_object": True}
    assert options.text == {"format": {"type": "json_object"}} and options.store


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "prompt": "y"}, "prompt"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({}, "input"),
    ],
)
def test_refused_fields_are_named(body: dict, param: str) -> None:
    with pytest.raises(ResponsesFieldError) as err:
        responses_fields(body)
    assert err.value.param == param


def test_thinking_becomes_a_reasoning_item() -> None:
    items = output_items("j", "<think>\nLet me see.\n</think>\n\nParis.", ResponseOptions())
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "Let me see."
    assert items[1]["content"][0]["text"] == "Paris."
    assert output_messages(items) == [{"role": "assistant", "content": "Paris."}]


def test_function_call_items_round_trip_as_chat_turns() -> None:
    body = {
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a": 2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
    }
    fields, _ = responses_fields(body)
    GenerationRequest.parse(fields)  # the job schema takes what the conversion gives
    turns = [m["role"] for m in fields["messages"]]
    assert turns == ["user", "assistant", "tool"]  # parallel calls are one assistant turn
    assert json.loads(fields["messages"][1]["content"] or "[]") or fields["messages"][1].get(
        "tool_calls"
    )

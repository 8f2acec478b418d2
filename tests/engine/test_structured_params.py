"""StructuredOutputsParams: exactly one kind, named errors, canonical specs (no model)."""

from __future__ import annotations

import pytest

from engine import SamplingParams, StructuredOutputsParams


def test_exactly_one_kind_is_set():
    with pytest.raises(
        ValueError, match="exactly one of json, regex, choice, grammar, json_object"
    ):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": 3}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"grammar": "  "}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_json_text_and_dict_are_the_same_constraint_and_keep_key_order():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert a.key == b.key and a.kind == "json"
    assert a.spec == '{"type":"object","properties":{"b":{},"a":{}}}'  # b stays before a
    assert StructuredOutputsParams(regex="a+").key != StructuredOutputsParams(grammar="a+").key


def test_sampling_params_take_a_dict_and_samples_share_the_constraint():
    params = SamplingParams(n=2, seed=1, structured_outputs={"choice": ["yes", "no"]})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.clone_for_sample(1).structured_outputs is params.structured_outputs
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['guided_json'\]"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(ValueError, match="structured_outputs=.* is invalid"):
        SamplingParams(structured_outputs="json")

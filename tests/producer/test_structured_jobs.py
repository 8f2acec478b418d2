"""Structured outputs through a real worker: the constraint on the wire (vLLM's and OpenAI's
names), every output that stopped valid, a bad schema failing its job alone, and
`pagedq submit --response-format` on a batch file."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from producer.bulk import run_bulk
from producer.contract.schema import GenerationRequest
from producer.errors import InvalidRequestError, JobFailedError
from producer.openai_batch import CHAT_URL

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Alan", "Grace"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# Random weights rarely end a free-form field: bounded shapes end by themselves.
SAMPLED = {"max_tokens": 48, "temperature": 1.0}


def test_the_wire_takes_one_constraint_by_vllms_or_openais_name():
    via_openai = GenerationRequest.parse(
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        }
    )
    assert via_openai.sampling_kwargs()["structured_outputs"] == {"json": PERSON}
    json_object = {"type": "json_object"}
    parsed = GenerationRequest.parse({"prompt": "x", "response_format": json_object})
    assert parsed.structured_outputs == {"json_object": True}
    text = GenerationRequest.parse({"prompt": "x", "response_format": {"type": "text"}})
    assert text.structured_outputs is None
    for bad, message in [
        ({"regex": "a", "choice": ["b"]}, "set exactly one of json, regex, choice"),
        ({"choice": []}, "choice: must be a non-empty list of strings"),
        ({"jsn": {}}, "unknown field(s) ['jsn']"),
        ({"json": {"enum": ["x" * 70_000]}}, "json: must be at most 65536 characters"),
    ]:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            GenerationRequest.parse({"prompt": "x", "structured_outputs": bad})
    with pytest.raises(InvalidRequestError, match="not both"):
        GenerationRequest.parse(
            {"prompt": "x", "structured_outputs": {"regex": "a"}, "response_format": json_object}
        )


def test_constrained_jobs_match_and_a_bad_schema_fails_alone(served):
    with served.client() as client:
        good = [
            client.submit(
                prompt=f"person {i}", seed=i, structured_outputs={"json": PERSON}, **SAMPLED
            )  # fmt: skip
            for i in range(4)
        ]
        choice = client.submit(
            prompt="pick", structured_outputs={"choice": ["yes", "no"]}, **SAMPLED
        )
        # ASCII digits spelled out: the grammar's \d also takes digits of Unicode versions newer
        # than Python's `re` knows (a sampled run once gave "20\u0e595-1\U0001ccf1").
        regex = client.submit(
            prompt="date", structured_outputs={"regex": r"20[0-9][0-9]-[01][0-9]"}, **SAMPLED
        )
        bad = client.submit(prompt="bad", structured_outputs={"regex": "(unclosed"}, **SAMPLED)
        results = [client.result(j, timeout=120) for j in good]
        stopped = [r for r in results if r.finish_reason == "stop"]
        assert stopped, [r.text for r in results]
        for r in stopped:
            jsonschema.validate(json.loads(r.text), PERSON)
        assert sum(r.usage.forced_tokens for r in results) > 0  # `{"name": "` and the like
        assert client.result(choice, timeout=120).text in ("yes", "no")
        assert re.fullmatch(r"20\d\d-[01]\d", client.result(regex, timeout=120).text)
        with pytest.raises(JobFailedError, match=r"structured_outputs\.regex"):
            client.result(bad, timeout=120)


def test_submit_response_format_applies_to_every_line_without_one(served, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"messages": [{"role": "user", "content": "who?"}], **SAMPLED}
    own = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["x", "y"]}}}
    lines = [
        {"custom_id": f"p{i}", "method": "POST", "url": CHAT_URL, "body": {**body, "seed": i}}
        for i in range(3)
    ]
    lines.append(
        {"custom_id": "own", "method": "POST", "url": CHAT_URL,
         "body": {**body, "response_format": own}}
    )  # fmt: skip
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    person = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    with served.client() as client:
        summary = run_bulk(client, str(src), str(out), progress=False, response_format=person)
    assert summary.finished == 4, out.read_text()
    rows = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    for custom_id, schema in [("p0", PERSON), ("p1", PERSON), ("p2", PERSON), ("own", None)]:
        choice = rows[custom_id]["response"]["body"]["choices"][0]
        if choice["finish_reason"] != "stop":
            continue
        value = json.loads(choice["message"]["content"])
        if schema is None:
            assert value in ("x", "y")
        else:
            jsonschema.validate(value, schema)

"""The clients dataset builders use, unchanged, against a real gateway and worker: OpenAI's SDK
(tools in all four choices, streamed tool deltas, parse), instructor, langchain-openai, LiteLLM;
reasoning_content, logit_bias, vLLM's guided_* fields, and backpressure (headers, 429)."""

from __future__ import annotations

import json
import os
import threading
from typing import Literal

import httpx
import jsonschema
import pytest
from gw_helpers import KEY, QUEUE, batch_file, wait_batch
from openai import OpenAI
from pydantic import BaseModel, ConfigDict

from producer.client import Client

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

WEATHER = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Qwen3-style think block, forced by a grammar so that the tiny random model writes one.
THINK_GRAMMAR = 'start: "<think>" /[a-z]{1,6}/ "</think>" /[a-z]{1,6}/'


# extra="forbid": the schema closes each object, so the tiny random model's answer ends (a
# schema open to more keys lets it write keys until max_tokens).
class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome"]
    coastal: bool


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["Ada", "Bob"]
    home: Address


def _valid_calls(message, finish_reason: str) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        if finish_reason == "tool_calls":
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.fixture(scope="module")
def gw(stack):
    """A gateway that cuts <think> blocks (the tiny model's template names no format)."""
    return stack.gateway("--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def oai(gw):
    return gw.openai()


def test_named_tool_choice_is_enforced(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = oai.chat.completions.create(
        model="any", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=32, temperature=0
    )
    c = answer.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    _valid_calls(c.message, c.finish_reason)


def test_required_tool_choice_gives_valid_calls(oai):
    answer = oai.chat.completions.create(
        model="any",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0,
    )
    c = answer.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    _valid_calls(c.message, c.finish_reason)


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_auto_and_none_answer_with_text(oai, tool_choice):
    # The tiny model's template speaks no tool-call format: its text stays content.
    answer = oai.chat.completions.create(
        model="any", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=6
    )
    c = answer.choices[0]
    assert c.message.tool_calls is None and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_build_the_whole_call(oai):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model="any", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=32)
    whole = oai.chat.completions.create(**kwargs, temperature=0).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(**kwargs, temperature=0, stream=True):
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            for d in choice_delta.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    expected = whole.message.tool_calls[0]
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_time", expected.function.arguments)
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)


def test_tool_history_is_rendered(oai):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    answer = oai.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=4)
    assert answer.usage.prompt_tokens > 20 and answer.choices[0].message.content is not None


def test_openai_parse_nested_model(oai):
    answer = oai.chat.completions.parse(
        model="any", messages=ASK, response_format=Person, max_tokens=48, temperature=0
    )
    c = answer.choices[0]
    assert c.finish_reason == "stop" and isinstance(c.message.parsed, Person)
    jsonschema.validate(json.loads(c.message.content), Person.model_json_schema())


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(gw, mode):
    import instructor

    client = instructor.from_openai(gw.openai(), mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(
        model="any", messages=ASK, response_model=Person, max_tokens=48, max_retries=0
    )
    assert isinstance(person, Person) and isinstance(person.home, Address)


def test_langchain_invoke_stream_and_structured_outputs(gw):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=gw.url + "/v1", api_key=KEY, model="any", max_tokens=6)
    assert isinstance(llm.invoke("Hi").content, str)
    assert "".join(chunk.content for chunk in llm.stream("Hi")) is not None
    longer = ChatOpenAI(base_url=gw.url + "/v1", api_key=KEY, model="any", max_tokens=48)
    for method in ("json_schema", "function_calling"):
        person = longer.with_structured_output(Person, method=method)
        assert isinstance(person.invoke("Who?"), Person), method


@pytest.mark.parametrize("prefix", ["openai", "hosted_vllm"])
def test_litellm_prefixes(gw, prefix):
    import litellm

    answer = litellm.completion(
        model=f"{prefix}/any", api_base=gw.url + "/v1", api_key=KEY, messages=ASK, max_tokens=4
    )
    assert answer.choices[0].message.content is not None and answer.usage.completion_tokens >= 1


def test_reasoning_content_whole_and_streamed(oai):
    kwargs = dict(
        model="any",
        messages=ASK,
        max_tokens=24,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": THINK_GRAMMAR}},
    )
    message = oai.chat.completions.create(**kwargs).choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and thinking.isalpha() and message.content.isalpha()
    reasoning, content = "", ""
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (thinking, message.content)


def test_logit_bias_is_honoured(oai):
    kwargs = dict(model="any", messages=ASK, max_tokens=1, temperature=0, logprobs=True)
    plain = oai.chat.completions.create(**kwargs).choices[0]
    first = plain.logprobs.content[0].token
    token_id = next(t for t in (42, 43, 44) if f"token_id:{t}" != first)
    biased = oai.chat.completions.create(**kwargs, logit_bias={str(token_id): 100}).choices[0]
    assert biased.logprobs.content[0].token != first
    banned = oai.chat.completions.create(**kwargs, logit_bias={"0": -100}).choices[0]
    assert banned.logprobs.content[0].token == first


def test_guided_fields_nulls_and_refused_schemas(gw, oai):
    answer = oai.chat.completions.create(
        model="any",
        messages=ASK,
        max_tokens=32,
        stop=None,
        user="u1",
        store=False,
        extra_body={"guided_json": TIME, "top_k": None, "prompt_cache_key": "k"},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), TIME)
    choice = oai.chat.completions.create(
        model="any", messages=ASK, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].message.content in ("yes", "no")
    bad = httpx.post(
        gw.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": ASK, "guided_regex": "(unclosed"},
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "guided_regex"
    unknown = httpx.post(
        gw.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": ASK, "functions": []},
    )
    assert unknown.status_code == 400 and "functions" in unknown.json()["error"]["message"]


def test_batch_lines_carry_tool_calls(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    lines = [
        {
            "custom_id": f"t{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 32,
                "stop": None,
                "metadata": {"row": str(i)},
            },
        }
        for i in range(3)
    ]
    # This gateway's --reasoning-parser cuts batch outputs too.
    think = {"messages": ASK, "max_tokens": 24, "structured_outputs": {"grammar": THINK_GRAMMAR}}
    lines.append({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": think})
    f = oai.files.create(file=("t.jsonl", batch_file(lines)), purpose="batch")
    batch = oai.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"set": "tools"},
        output_expires_after={"anchor": "created_at", "seconds": 86400},
    )
    batch = wait_batch(oai, batch.id, ("completed",))
    assert batch.request_counts.completed == 4 and batch.metadata == {"set": "tools"}
    kept = {"anchor": "created_at", "seconds": 86400}
    assert batch.model_extra["output_expires_after"] == kept
    rows = [json.loads(x) for x in oai.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["r", "t0", "t1", "t2"]
    (thought,) = [
        r["response"]["body"]["choices"][0]["message"] for r in rows if r["custom_id"] == "r"
    ]
    assert thought["reasoning_content"].isalpha() and thought["content"].isalpha()
    for row in (r for r in rows if r["custom_id"] != "r"):
        c = row["response"]["body"]["choices"][0]
        assert c["finish_reason"] == "tool_calls"
        (call,) = c["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_rate_limit_headers_and_429_then_retry(stack, gw):
    headers = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).headers
    assert int(headers["x-ratelimit-limit-requests"]) >= 1
    assert int(headers["x-ratelimit-limit-tokens"]) >= int(headers["x-ratelimit-limit-requests"])
    assert "x-ratelimit-remaining-requests" in headers and "x-ratelimit-reset-tokens" in headers
    small = stack.gateway("--max-queue-depth", "2")
    client = Client(stack.redis_url, queue=QUEUE)
    # Jobs for a model no worker serves wait in the queue (gw@that-model) until canceled.
    fillers = client.submit_many(
        {"prompt": "filler", "max_tokens": 1, "model": "no-worker-serves-this"} for _ in range(3)
    )
    statuses: list[int] = []
    try:
        refused = httpx.post(
            small.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"messages": ASK, "max_tokens": 2},
        )
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        # The queue drains while the SDK waits out retry-after; its own retry then succeeds.
        drain = threading.Timer(0.5, lambda: [client.cancel(j) for j in fillers])
        hook = {"response": [lambda response: statuses.append(response.status_code)]}
        retrying = OpenAI(
            base_url=small.url + "/v1",
            api_key=KEY,
            max_retries=5,
            http_client=httpx.Client(event_hooks=hook),
        )
        drain.start()
        answer = retrying.chat.completions.create(model="any", messages=ASK, max_tokens=2)
        drain.join()
        assert answer.choices[0].message.content is not None
        assert statuses[0] == 429 and statuses[-1] == 200, statuses
    finally:
        for job_id in fillers:
            client.cancel(job_id)
        client.close()

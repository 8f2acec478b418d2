"""A worker serving a tiny random Qwen3 with a Qwen3-style chat template (tools, <tool_call>,
<think>, enable_thinking): the formats it finds there reach the gateway, which then cuts
answers with no flag given, online and in batch output files."""

from __future__ import annotations

import json

import jsonschema
import pytest
from gw_helpers import QUEUE, batch_file, wait_batch
from worker_process import WorkerProcess

from producer.status import read_worker_statuses

# The parts of Qwen3's chat template that tools and thinking use.
QWEN3_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What time is it?"}]
# The model's own format, written by the tiny random model under a grammar.
# (Compact JSON: lark's %json lets whitespace in, where a random model would loop.)
HERMES_CALL = (
    'start: "<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": " args '
    '"}\\n</tool_call>"\n'
    "args: %json " + json.dumps({**TIME, "x-guidance": {"whitespace_flexible": False}})
)
THINK = 'start: "<think>" /[a-z]{1,6}/ "</think>" /[a-z]{1,6}/'


@pytest.fixture(scope="module")
def qwen3(stack, tmp_path_factory):
    """A second worker on the same queue, serving the Qwen3-templated model; its model id."""
    from tiny_models import make_tiny_model
    from transformers import AutoTokenizer

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(folder)
    worker = WorkerProcess(
        stack.redis_url,
        QUEUE,
        "qwen3-tests",
        stack.log_dir,
        model=str(folder),
        kv_cache_memory="16MiB",
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        worker.wait_ready(timeout=120)
        (status,) = [s for s in read_worker_statuses(stack.redis) if "qwen3" in s["name"]]
        yield status
    finally:
        worker.stop(timeout=15)


@pytest.fixture(scope="module")
def oai(stack):
    return stack.gateway().openai()


def test_the_worker_publishes_the_formats_of_its_template(qwen3):
    assert qwen3["config"]["tool_call_parser"] == "hermes"
    assert qwen3["config"]["reasoning_parser"] == "qwen3"


def test_chat_template_kwargs_reach_the_template(oai, qwen3):
    kwargs = dict(model=qwen3["model"], messages=ASK, max_tokens=1)
    thinking = oai.chat.completions.create(**kwargs).usage.prompt_tokens
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = oai.chat.completions.create(**kwargs, extra_body=off).usage.prompt_tokens
    with_tools = oai.chat.completions.create(**kwargs, tools=TOOLS).usage.prompt_tokens
    assert plain > thinking and with_tools > thinking + 20


def test_auto_tool_choice_parses_the_models_own_format(oai, qwen3):
    answer = oai.chat.completions.create(
        model=qwen3["model"],
        messages=ASK,
        tools=TOOLS,
        max_tokens=64,
        extra_body={"structured_outputs": {"grammar": HERMES_CALL}},
    )
    c = answer.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    # Streamed: the call comes whole at the end, as one tool-call delta.
    deltas, finish = [], None
    for chunk in oai.chat.completions.create(
        model=qwen3["model"],
        messages=ASK,
        tools=TOOLS,
        max_tokens=64,
        stream=True,
        extra_body={"structured_outputs": {"grammar": HERMES_CALL}},
    ):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            deltas += choice.delta.tool_calls or []
    assert finish == "tool_calls" and len(deltas) == 1
    assert deltas[0].function.name == "get_time" and deltas[0].id.startswith("call_")
    jsonschema.validate(json.loads(deltas[0].function.arguments), TIME)


def test_thinking_lands_in_reasoning_content_online_and_in_batch_output(oai, qwen3):
    body = {
        "model": qwen3["model"],
        "messages": ASK,
        "max_tokens": 24,
        "structured_outputs": {"grammar": THINK},
    }
    message = oai.chat.completions.create(
        **{k: v for k, v in body.items() if k != "structured_outputs"},
        extra_body={"structured_outputs": {"grammar": THINK}},
    ).choices[0]
    assert message.message.model_extra["reasoning_content"].isalpha()
    # Batch lines go to the shared queue: either worker may run one, and each answer is cut by
    # the formats of the model that ran it (the result names them).
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(6)
    ]
    f = oai.files.create(file=("r.jsonl", batch_file(lines)), purpose="batch")
    batch = oai.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_batch(oai, batch.id, ("completed",))
    rows = [json.loads(x) for x in oai.files.content(batch.output_file_id).text.splitlines()]
    assert len(rows) == batch.request_counts.completed == 6
    for row in rows:
        msg = row["response"]["body"]["choices"][0]["message"]
        if row["response"]["body"]["model"] == qwen3["model"]:
            assert msg["reasoning_content"].isalpha() and msg["content"].isalpha()
        else:  # the tiny Llama's template names no reasoning format
            assert "reasoning_content" not in msg and msg["content"].startswith("<think>")

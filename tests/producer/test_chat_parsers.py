"""Tool-call and reasoning parsers on strings rendered by chat templates of each family's format,
the think grammar against llguidance, and what a stream's partial text may show."""

from __future__ import annotations

import json

import jinja2
import pytest

from producer.chat_answer import AnswerFormat
from producer.reasoning import split_reasoning, think_grammar
from producer.tool_parsers import parse_tool_calls
from worker.template_formats import formats_of

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
# The assistant turn of each family, as its template renders an assistant message with one
# tool call (the parts of Qwen3's, Llama 3.1's, Mistral's and gpt-oss's templates that do it).
TEMPLATES = {
    "hermes": "{% for c in calls %}<tool_call>\n{{ {'name': c.name, 'arguments': c.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}",
    "llama3_json": "<|python_tag|>{{ {'name': calls[0].name, 'parameters': calls[0].arguments}"
    " | tojson }}",
    "mistral": "[TOOL_CALLS][{% for c in calls %}{{ {'name': c.name, 'arguments': c.arguments}"
    " | tojson }}{% endfor %}]",
    "openai": "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
    "commentary to=functions.{{ calls[0].name }} <|constrain|>json<|message|>"
    "{{ calls[0].arguments | tojson }}<|call|>",
}


@pytest.mark.parametrize("parser", sorted(TEMPLATES))
def test_each_family_format_parses_to_the_call(parser):
    text = jinja2.Environment().from_string(TEMPLATES[parser]).render(calls=[CALL])
    found = parse_tool_calls(parser, "Let me check. " * (parser in ("hermes", "mistral")) + text)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        (CALL["name"], CALL["arguments"])
    ]


def test_text_without_a_well_formed_call_stays_content():
    for parser in ("hermes", "llama3_json", "mistral", "openai"):
        assert parse_tool_calls(parser, "Paris is sunny.").content == "Paris is sunny."
    broken = '<tool_call>\n{"name": "x", "argu'
    assert parse_tool_calls("hermes", broken).calls == []


def test_reasoning_splits():
    split = split_reasoning("qwen3", "<think>\nhm\n</think>\n\nOK")
    assert (split.reasoning, split.content) == ("hm", "OK")
    assert split_reasoning("qwen3", "no thinking").reasoning is None
    split = split_reasoning("deepseek_r1", "cut short by max_tokens")
    assert (split.reasoning, split.content) == ("cut short by max_tokens", "")
    harmony = (
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    )
    split = split_reasoning("openai_gptoss", harmony)
    assert (split.reasoning, split.content) == ("think", "Hi")


def test_stream_parts_only_grow_and_end_as_the_whole():
    answer = AnswerFormat(mode="auto", tool_call_parser="hermes", reasoning_parser="qwen3")
    text = '<think>plan</think>Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    seen = []
    for end in range(len(text) + 1):
        seen.append(answer.partial(text[:end]))
    for before, after in zip(seen, seen[1:]):
        assert after.reasoning.startswith(before.reasoning)
        assert after.content.startswith(before.content)
    whole = answer.parts(text, "stop", "job", 0)
    assert (whole.reasoning, whole.content, whole.finish_reason) == ("plan", "Sure.", "tool_calls")
    assert seen[-1].content == "Sure. " and whole.tool_calls[0]["function"]["name"] == "f"


def test_template_formats():
    f = formats_of("<tool_call> enable_thinking </think>")
    assert (f.tool_call_parser, f.reasoning_parser) == ("hermes", "qwen3")
    assert formats_of("<|channel|>").tool_call_parser == "openai"
    assert formats_of("plain").summary() == {}


def test_think_grammar_lets_thinking_through_then_enforces_the_schema():
    pytest.importorskip("llguidance")
    import llguidance
    import llguidance.hf

    from engine.model_loader import load_tokenizer, resolve_model
    from engine.structured_outputs.grammar import JSON_DEFAULTS

    tok = load_tokenizer(resolve_model("smollm2"))
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = think_grammar({"json": schema}, JSON_DEFAULTS)["grammar"]

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()

    assert accepts('<think>a </thin b</think>\n\n{"a": 1}')
    assert accepts('opened in the prompt</think>{"a": 2}')
    assert not accepts('<think>x</think>{"b": 2}')
    assert not accepts('{"a": 1}')


def test_a_thinking_worker_moves_the_constraint_after_the_think_block():
    from producer.contract.schema import GenerationRequest
    from worker.chat import chat_sampling
    from worker.template_formats import TemplateFormats

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = GenerationRequest.parse(
        {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"json": schema}}
    )
    kwargs = request.sampling_kwargs()
    thinking = chat_sampling(dict(kwargs), request, TemplateFormats("hermes", "qwen3"))
    assert thinking["structured_outputs"]["grammar"].startswith("THINK:")
    off = request.model_copy(update={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat_sampling(dict(kwargs), off, TemplateFormats("hermes", "qwen3")) == kwargs
    assert chat_sampling(dict(kwargs), request, TemplateFormats()) == kwargs
    harmony = chat_sampling(dict(kwargs), request, TemplateFormats("openai", "openai_gptoss"))
    assert harmony["skip_special_tokens"] is False

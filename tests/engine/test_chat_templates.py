"""Chats render with the checkpoint's own template, and generation stops where the checkpoint's
``generation_config.json`` says, as Hugging Face's ``apply_chat_template`` and ``generate`` do."""

from __future__ import annotations

import json

import torch
from tiny_models import make_tiny_model

from engine import SamplingParams
from tests.engine.test_architectures import GEMMA, one_thread, tiny_llm  # noqa: F401

# Gemma 3's chat template as its checkpoints ship it (system text joins the first user turn;
# "assistant" is "model").
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

MESSAGES = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "And of Italy?"},
]


def test_gemma3_chat_renders_and_stops_as_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_tiny_model(tmp_path / "gemma3", "gemma3_text", **GEMMA, sliding_window=8)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(folder)

    expected_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    if hasattr(expected_ids, "keys"):
        expected_ids = expected_ids["input_ids"]
    text = tokenizer.decode(expected_ids)
    assert "<start_of_turn>user\nAnswer in one word.\n\nWhat is the capital" in text
    assert text.endswith("<end_of_turn>\n<start_of_turn>model\n")

    # The checkpoint's generation config ends turns at a token the model reaches greedily.
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.tensor([expected_ids])
    with torch.inference_mode():
        free = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    stop_at = free[0, len(expected_ids) + 2].item()
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, stop_at], "pad_token_id": 0})
    )
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        stopped = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    hf_tokens = stopped[0, len(expected_ids) :].tolist()

    out = tiny_llm(folder).chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt_token_ids == list(expected_ids)
    assert out.outputs[0].token_ids == hf_tokens
    assert hf_tokens[-1] == stop_at and out.outputs[0].finish_reason == "stop"

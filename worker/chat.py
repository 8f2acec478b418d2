"""A chat job as the engine takes it: the prompt with its tools and template keywords, and
sampling that keeps the thinking free when the answer is constrained."""

from __future__ import annotations

from typing import Any

from engine.prompts import ChatPrompt

# The engine's JSON settings (engine/structured_outputs/grammar.py), kept after a think block.
from engine.structured_outputs.grammar import JSON_DEFAULTS
from producer.contract.schema import GenerationRequest
from producer.reasoning import think_grammar, thinks
from worker.template_formats import TemplateFormats


def chat_prompt(request: GenerationRequest) -> ChatPrompt:
    """The ChatPrompt of a chat job (messages without unset fields, as templates test them)."""
    messages = [m.model_dump(exclude_none=True) for m in request.messages or []]
    for message in messages:
        message.setdefault("content", "")
    return ChatPrompt(messages, request.tools, request.chat_template_kwargs)


def chat_sampling(
    kwargs: dict[str, Any], request: GenerationRequest, formats: TemplateFormats
) -> dict[str, Any]:
    """SamplingParams keywords of a chat job: special tokens kept where the model's formats
    are written with them; a structured output moved after the thinking of a thinking model."""
    if request.messages is None:
        return kwargs
    if formats.keeps_special_tokens:
        kwargs["skip_special_tokens"] = False
    structured = kwargs.get("structured_outputs")
    if structured and thinks(formats.reasoning_parser, request.chat_template_kwargs):
        kwargs["structured_outputs"] = think_grammar(structured, JSON_DEFAULTS) or structured
    return kwargs

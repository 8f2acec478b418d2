"""A finished job as OpenAI's Responses object (`object: "response"`), online and in batch
output lines: output items (a `reasoning` item when the model thought, `function_call` items
when it called tools, else one assistant `message` with an `output_text` part), usage, and the
request's echoed fields.
"""

from __future__ import annotations

import json
import time
from typing import Any

from producer.contract.schema import GenerationRequest, GenerationResult
from producer.openai_responses import ResponseOptions, forced_calls

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def response_id(job_id: str) -> str:
    """The Responses id of a job."""
    return f"resp_{job_id}"


def split_reasoning(text: str, parser: str | None = None) -> tuple[str | None, str]:
    """(thinking, answer): by the worker's reasoning parser when it names one (the chat
    reasoning parsers, producer/reasoning.py), else a text that opens with `<think>`."""
    if parser is not None:
        try:
            from producer import reasoning
        except ImportError:  # before the chat reasoning parsers
            pass
        else:
            split = reasoning.split_reasoning(parser, text)
            return split.reasoning, split.content
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return None, text
    inner = stripped[len(THINK_OPEN) :]
    thinking, closed, answer = inner.partition(THINK_CLOSE)
    if not closed:
        return thinking, ""
    return thinking.strip("\n"), answer.lstrip("\n")


def tool_calls(
    text: str, options: ResponseOptions, parser: str | None = None
) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each function the answer calls, or None for a text answer.

    The one place tool calls are read. Without `tools` in the job schema, the calls of a
    forced tool_choice (the JSON-schema constraint of producer/openai_responses.py); with it,
    the chat tool-call work's forms: a named choice's output is the arguments, `required`'s
    an array of {name, parameters} (producer/contract/tool_choice.py), and `auto`'s the
    family's own format, read by the worker's `parser` (producer/tool_parsers.py)."""
    if "tools" not in GenerationRequest.model_fields:
        return forced_calls(text, options.forced)
    if options.forced == "required":
        try:
            calls = json.loads(text)
            return [(c["name"], json.dumps(c["parameters"])) for c in calls] or None
        except (ValueError, TypeError, KeyError):
            return None
    if options.forced is not None:
        return [(options.forced, text)]
    from producer.tool_parsers import parse_tool_calls

    found = parse_tool_calls(parser, text)
    return [(c.name, c.arguments) for c in found.calls] or None


def output_items(
    job_id: str, text: str, options: ResponseOptions, result: GenerationResult | None = None
) -> list[dict[str, Any]]:
    """The output items of a finished answer `text` (`result`: the formats its worker's chat
    template speaks, when it says)."""
    parts = chat_parts(job_id, text, options, result)
    if parts is not None:
        return parts
    items: list[dict[str, Any]] = []
    thinking, answer = split_reasoning(text, getattr(result, "reasoning_parser", None))
    if thinking is not None:
        items.append(reasoning_item(job_id, thinking))
    parser = getattr(result, "tool_call_parser", None)
    calls = tool_calls(answer, options, parser) if options.tools else None
    if calls:
        for k, (name, arguments) in enumerate(calls):
            items.append(function_call_item(job_id, k, name, arguments))
        return items
    items.append(message_item(job_id, answer))
    return items


def chat_parts(
    job_id: str, text: str, options: ResponseOptions, result: GenerationResult | None
) -> list[dict[str, Any]] | None:
    """The items of an answer cut by the chat tool-call work's `AnswerFormat` (reasoning,
    content, tool calls: the same cut as chat completions), None before that work is in."""
    try:
        from producer.chat_answer import AnswerFormat
    except ImportError:
        return None
    if options.forced == "required":
        mode = "required"
    elif options.forced is not None:
        mode = "named"
    else:
        mode = "auto" if options.tools and options.tool_choice != "none" else "none"
    answer = AnswerFormat(
        mode=mode,
        function=options.forced if mode == "named" else None,
        parallel_tool_calls=options.parallel_tool_calls,
        tool_call_parser=getattr(result, "tool_call_parser", None),
        reasoning_parser=getattr(result, "reasoning_parser", None),
    )
    finish = result.all_choices()[0].finish_reason if result is not None else None
    parts = answer.parts(text, finish, job_id, 0)
    items: list[dict[str, Any]] = []
    if parts.reasoning is not None:
        items.append(reasoning_item(job_id, parts.reasoning))
    if (parts.content or "").strip() or not parts.tool_calls:
        items.append(message_item(job_id, parts.content or ""))
    for k, call in enumerate(parts.tool_calls):
        function = call["function"]
        item = function_call_item(job_id, k, function["name"], function["arguments"])
        items.append({**item, "call_id": call["id"]})
    return items


def reasoning_item(job_id: str, thinking: str, status: str = "completed") -> dict[str, Any]:
    """A `reasoning` item holding the model's thinking as reasoning_text."""
    return {
        "type": "reasoning",
        "id": f"rs_{job_id}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": thinking}],
        "status": status,
    }


def function_call_item(job_id: str, k: int, name: str, arguments: str) -> dict[str, Any]:
    """A `function_call` item (call_id is what the function_call_output answers)."""
    return {
        "type": "function_call",
        "id": f"fc_{job_id}_{k}",
        "call_id": f"call_{job_id}_{k}",
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def output_text_part(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(job_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The assistant `message` item with one output_text part."""
    content = [output_text_part(text)] if status == "completed" else []
    return {
        "type": "message",
        "id": f"msg_{job_id}",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def response_object(
    job_id: str,
    options: ResponseOptions,
    model: str,
    created_at: int | None = None,
    result: GenerationResult | None = None,
    status: str | None = None,
) -> dict[str, Any]:
    """The Response of a job: in progress (no result yet), or from its finished result."""
    output: list[dict[str, Any]] = []
    usage = None
    incomplete = None
    error = None
    if result is not None:
        choice = result.all_choices()[0]
        if result.status == "finished":
            output = output_items(job_id, choice.text, options, result)
            status = status or "completed"
            if choice.finish_reason == "length":
                status = "incomplete"
                incomplete = {"reason": "max_output_tokens"}
        else:
            status = "failed"
            error = {"code": "server_error", "message": result.error or "the job failed"}
        u = result.usage
        usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        }
    return {
        "id": response_id(job_id),
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": status or "in_progress",
        "error": error,
        "incomplete_details": incomplete,
        "instructions": options.instructions,
        "max_output_tokens": options.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": options.parallel_tool_calls,
        "previous_response_id": options.previous_response_id,
        "reasoning": options.reasoning or {"effort": None, "summary": None},
        "store": options.store,
        "temperature": options.temperature if options.temperature is not None else 1.0,
        "text": options.text,
        "tool_choice": options.tool_choice,
        "tools": options.tools,
        "top_p": options.top_p if options.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": options.metadata or {},
    }


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat turns an answer's output items add to its conversation (for
    `previous_response_id`): its text, or its function calls; reasoning is left out."""
    messages: list[dict[str, Any]] = []
    calls = []
    for item in items:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    if calls:
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    return messages

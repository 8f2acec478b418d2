"""A chat answer's text cut into `reasoning_content`, `content` and `tool_calls`.

How depends on the request (its tools and tool_choice) and on the formats the model speaks
(its reasoning and tool-call parsers: those the worker found in its chat template, carried in
the result, or those `pagedq serve --reasoning-parser/--tool-call-parser` names). A named tool
choice's output is its arguments; a `required` one's a JSON array of {"name", "parameters"}
(producer/contract/tool_choice.py); `auto` parses the model's own format. Tool-call ids derive
from the job id, so every read of a batch's output file gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from producer.contract.schema import GenerationRequest, GenerationResult
from producer.contract.tool_choice import named_function, tool_mode
from producer.reasoning import THINK_START, split_reasoning
from producer.tool_parsers import ParsedCall, content_before_calls, parse_tool_calls


@dataclass(frozen=True, slots=True)
class ChatParts:
    """The pieces of one chat choice's message."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class PartialParts:
    """What a stream's text so far surely is: thinking, content, and a named call's arguments."""

    reasoning: str = ""
    content: str = ""
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class AnswerFormat:
    """How to cut the answers of one request."""

    mode: str = "none"  # none, auto, required or named (producer/contract/tool_choice.py)
    function: str | None = None
    parallel_tool_calls: bool = True
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @classmethod
    def of(
        cls,
        request: GenerationRequest | None,
        result: GenerationResult | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> AnswerFormat:
        """The format of `request`'s answers; explicit parser names win over the result's."""
        tools = request.tools if request is not None else None
        choice = request.tool_choice if request is not None else None
        return cls(
            mode=tool_mode(tools, choice),
            function=named_function(choice),
            parallel_tool_calls=request is None or request.parallel_tool_calls is not False,
            tool_call_parser=tool_call_parser or (result.tool_call_parser if result else None),
            reasoning_parser=reasoning_parser or (result.reasoning_parser if result else None),
        )

    def parts(self, text: str, finish_reason: str | None, job_id: str, index: int) -> ChatParts:
        """The message of a whole answer."""
        split = split_reasoning(self.reasoning_parser, text)
        rest, calls = split.content, []
        content: str | None = rest
        if self.mode == "named" and self.function is not None:
            calls, content = [ParsedCall(self.function, rest)], None
        elif self.mode == "required":
            calls = _required_calls(rest)
            content = None if calls else rest
        elif self.mode == "auto":
            found = parse_tool_calls(self.tool_call_parser, rest)
            calls, content = found.calls, found.content
        if calls and not self.parallel_tool_calls:
            calls = calls[:1]
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return ChatParts(
            content=content,
            reasoning=split.reasoning,
            tool_calls=[_tool_call(c, job_id, index, i) for i, c in enumerate(calls)],
            finish_reason=finish_reason,
        )

    def partial(self, text: str) -> PartialParts:
        """What a stream's text so far surely is (each field only grows as text comes)."""
        if self.reasoning_parser in ("qwen3", "deepseek_r1") and THINK_START.startswith(
            text.lstrip()
        ):
            return PartialParts()  # maybe the start of a think block
        split = split_reasoning(self.reasoning_parser, text)
        reasoning, rest = split.reasoning or "", split.content
        if self.mode == "named":
            return PartialParts(reasoning, "", rest)
        if self.mode == "required":
            return PartialParts(reasoning)
        if self.mode == "auto":
            return PartialParts(reasoning, content_before_calls(self.tool_call_parser, rest))
        return PartialParts(reasoning, rest)

    @property
    def buffers_calls(self) -> bool:
        """True when tool calls come whole at the end of a stream (parsed, not streamed)."""
        return self.mode in ("auto", "required")


def tool_call_id(job_id: str, index: int, position: int) -> str:
    """A call's id: the same on every read of the same job's answer."""
    digest = hashlib.sha256(f"{job_id}:{index}:{position}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _tool_call(call: ParsedCall, job_id: str, index: int, position: int) -> dict[str, Any]:
    return {
        "id": tool_call_id(job_id, index, position),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _required_calls(text: str) -> list[ParsedCall]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ParsedCall(item["name"], args))
    return calls

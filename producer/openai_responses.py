"""OpenAI's Responses API request, as a pagedq chat job (online and in batch lines).

`responses_fields(body, history)` turns a `/v1/responses` body into the job's fields plus the
`ResponseOptions` its answer is shaped by. `input` is a text or a list of items: messages
(`role` + text or `input_text`/`output_text` parts), `function_call` and
`function_call_output` items (an assistant turn calling tools, and the tools' answers),
`reasoning` items (skipped: a model never sees its earlier thinking). `instructions` becomes a
leading system message; `history` (the turns of `previous_response_id`) comes before it all.

Honoured: input, instructions, max_output_tokens, temperature, top_p, text.format
(json_schema, json_object, text), tools (function tools), tool_choice, parallel_tool_calls,
metadata, model, stream, store, previous_response_id (by the caller). Accepted without
effect on the output: reasoning, user, service_tier, safety_identifier, prompt_cache_key,
truncation "disabled", include, background false. Anything else is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from producer.contract.schema import GenerationRequest

RESPONSES_URL = "/v1/responses"
HONOURED = (
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "metadata",
    "model",
    "stream",
    "store",
    "previous_response_id",
)
ACCEPTED = (
    "reasoning",
    "user",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "truncation",
    "include",
    "background",
)
TEXT_FORMATS = ("text", "json_schema", "json_object")


class ResponsesFieldError(ValueError):
    """A refused body field; `param` names it (dotted, e.g. `text.format.type`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ResponseOptions:
    """What shapes a Responses answer beyond the job's result: the request's echoed fields,
    and which function (if any) the output is constrained to call."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    # "name" of a forced function, "required" for any, None for free text (auto / none).
    forced: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (batch lines carry it beside their request)."""
        return asdict(self)


def responses_fields(
    body: dict[str, Any], history: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], ResponseOptions]:
    """(job fields, options) of a Responses body; ResponsesFieldError names a refused field.
    `model`, `stream` and `previous_response_id` are left to the caller."""
    for name, value in body.items():
        if name not in HONOURED and name not in ACCEPTED and value is not None:
            raise ResponsesFieldError(
                f"unknown field {name!r} for responses (allowed: {', '.join(HONOURED + ACCEPTED)})",
                name,
            )
    if body.get("background"):
        raise ResponsesFieldError("background responses are not supported", "background")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise ResponsesFieldError("truncation must be 'disabled' or 'auto'", "truncation")
    if body.get("input") is None:
        raise ResponsesFieldError("input is required", "input")
    options = ResponseOptions(
        instructions=_optional(body, "instructions", str),
        max_output_tokens=_optional(body, "max_output_tokens", int),
        temperature=_optional(body, "temperature", float | int),
        top_p=_optional(body, "top_p", float | int),
        reasoning=_optional(body, "reasoning", dict),
        metadata=_optional(body, "metadata", dict),
        store=body.get("store") is not False,
        previous_response_id=body.get("previous_response_id"),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
    )
    messages = list(history or [])
    if options.instructions:
        messages.append({"role": "system", "content": options.instructions})
    messages += input_messages(body["input"])
    fields: dict[str, Any] = {}
    if options.max_output_tokens is not None:
        fields["max_tokens"] = options.max_output_tokens
    for name in ("temperature", "top_p", "metadata"):
        if getattr(options, name) is not None:
            fields[name] = getattr(options, name)
    _text_format(body.get("text"), options, fields)
    _tools(body, options, fields)
    fields["messages"] = messages
    return wire_fields(fields, options), options


def _optional(body: dict[str, Any], name: str, kind: Any) -> Any:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise ResponsesFieldError(f"{name} has the wrong type: {value!r:.80}", name)
    return value


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages (OpenAI's chat shape: assistant `tool_calls`, `tool` answers) of a
    Responses `input`."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ResponsesFieldError("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ResponsesFieldError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _text(item, "name", where),
                    "arguments": _text(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            call_id = _text(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise ResponsesFieldError(
                f"{where}.type must be message, function_call, function_call_output or "
                f"reasoning, got {kind!r:.80}",
                f"{where}.type",
            )
    if not messages:
        raise ResponsesFieldError("input holds no message", "input")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ResponsesFieldError(
            f"{where}.role must be user, assistant, system or developer, got {role!r:.80}",
            f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise ResponsesFieldError(
                    f"{where}.content[{j}]: only input_text / output_text parts are supported, "
                    f"got {kind!r:.80}",
                    f"{where}.content",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ResponsesFieldError(f"{where}.content must be text or text parts", f"{where}.content")
    return {"role": role, "content": content}


def _text(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ResponsesFieldError(f"{where}.{name} must be a string", f"{where}.{name}")
    return value


def _text_format(text: Any, options: ResponseOptions, fields: dict[str, Any]) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise ResponsesFieldError("text must be an object", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TEXT_FORMATS:
        raise ResponsesFieldError(
            f"text.format.type must be one of {TEXT_FORMATS}, got {kind!r:.80}",
            "text.format.type",
        )
    options.text = {"format": fmt}
    if kind == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ResponsesFieldError(
                "text.format.schema must be a JSON schema object", "text.format.schema"
            )
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}


def _tools(body: dict[str, Any], options: ResponseOptions, fields: dict[str, Any]) -> None:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ResponsesFieldError("tools must be a list", "tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ResponsesFieldError(
                f"tools[{i}].type: only function tools are supported, got {kind!r:.80}",
                f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ResponsesFieldError(f"tools[{i}].name must be a string", f"tools[{i}].name")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        chat_tools.append({"type": "function", "function": function})
    options.tools = tools
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    names = [t["function"]["name"] for t in chat_tools]
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or name not in names:
            raise ResponsesFieldError(
                f"tool_choice must name one of the function tools {names}, got {choice!r:.120}",
                "tool_choice",
            )
        chat_choice: Any = {"type": "function", "function": {"name": name}}
        options.forced = name
    elif choice in ("auto", "none", "required"):
        chat_choice = choice
        if choice == "required":
            if not chat_tools:
                raise ResponsesFieldError("tool_choice 'required' needs tools", "tool_choice")
            options.forced = "required"
    else:
        raise ResponsesFieldError(
            f"tool_choice must be auto, none, required or a function, got {choice!r:.80}",
            "tool_choice",
        )
    options.tool_choice = choice
    if chat_tools and choice != "none":
        if options.forced and "response_format" in fields:
            raise ResponsesFieldError(
                "a forced tool_choice constrains the output: give no text.format with it",
                "tool_choice",
            )
        fields["tools"] = chat_tools
        fields["tool_choice"] = chat_choice
        if body.get("parallel_tool_calls") is not None:
            fields["parallel_tool_calls"] = body["parallel_tool_calls"]


# --- until the job schema takes tools -----------------------------------------------------------
def wire_fields(fields: dict[str, Any], options: ResponseOptions) -> dict[str, Any]:
    """`fields` as the job schema takes them. Where GenerationRequest has `tools` (the chat
    tool-call work), they pass as they are; before it, a forced function is enforced here with
    a JSON-schema constraint, the tools are described in a system message, and tool turns of
    the history are written as text."""
    if "tools" in GenerationRequest.model_fields:
        return fields
    tools = fields.pop("tools", None)
    fields.pop("tool_choice", None)
    fields.pop("parallel_tool_calls", None)
    fields["messages"] = [_plain_message(m) for m in fields["messages"]]
    if not tools:
        return fields
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if options.forced in by_name:
        schema = by_name[options.forced]["parameters"] or {"type": "object"}
    elif options.forced == "required":
        schema = {"anyOf": [_call_schema(f) for f in by_name.values()]}
    else:
        schema = None
    if schema is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "tool_call", "schema": schema},
        }
    described = "You can call these functions:\n" + json.dumps([t["function"] for t in tools])
    fields["messages"] = [{"role": "system", "content": described}, *fields["messages"]]
    return fields


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": function["parameters"] or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message["tool_calls"]
        ]
        return {"role": "assistant", "content": json.dumps(calls)}
    if message["role"] == "tool":
        return {"role": "tool", "content": message["content"]}
    return message


def forced_calls(text: str, forced: str | None) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) calls of an output constrained by `wire_fields`'s schema;
    None when the output is not such a call."""
    if forced is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if forced != "required":
        return [(forced, json.dumps(value))]
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return [(value["name"], json.dumps(value.get("arguments", {})))]
    return None

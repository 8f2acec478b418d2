"""Function tools on the wire: `tools`, `tool_choice`, `parallel_tool_calls` (OpenAI's shapes).

A named or `required` tool choice is enforced by the structured-output engine, as vLLM does:
a named function's output is its arguments, matching the function's `parameters` schema; a
`required` output is a JSON array of `{"name", "parameters"}` objects, one per call, each
matching its function's schema. `auto` and `none` constrain nothing: the model's own tool-call
format is parsed from its text (producer/tool_parsers.py).
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CHOICE_MODES = ("none", "auto", "required")
MAX_TOOLS = 128
# A function without `parameters` takes an empty object, as OpenAI documents.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """`tools`, checked: [{"type": "function", "function": {"name", "parameters"?, ...}}]."""
    if not tools:
        raise ValueError("must hold at least one tool (omit it for none)")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'[{i}]: must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f'[{i}].function: must be an object with a "name" string')
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"[{i}].function.parameters: must be a JSON Schema object")
        if function["name"] in names:
            raise ValueError(f"[{i}].function.name: {function['name']!r} is given twice")
        names.add(function["name"])
    return tools


def check_tool_choice(value: Any) -> str | dict[str, Any]:
    """`tool_choice`: "none", "auto", "required" or {"type": "function", "function": {"name"}}."""
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise ValueError(
                f"must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r:.80}'
            )
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
    ):
        return value
    raise ValueError(
        'must be "none", "auto", "required" or '
        f'{{"type": "function", "function": {{"name": ...}}}}, got {json.dumps(value)[:80]}'
    )


def named_function(tool_choice: Any) -> str | None:
    """The function a tool choice names (None for the string modes)."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def tool_mode(tools: list[dict] | None, tool_choice: Any) -> str:
    """ "none", "auto", "required" or "named": OpenAI's default is auto when tools are given."""
    if not tools:
        return "none"
    if tool_choice is None:
        return "auto"
    return "named" if isinstance(tool_choice, dict) else tool_choice


def parameters_of(tools: list[dict], name: str) -> dict[str, Any]:
    """The `parameters` schema of the function `name` (ValueError when no tool has it)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters", EMPTY_PARAMETERS)
    known = ", ".join(t["function"]["name"] for t in tools)
    raise ValueError(f"function {name!r} is not among the tools ({known})")


def forced_schema(
    tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> dict[str, Any] | None:
    """The JSON Schema a named or `required` choice constrains the output to (else None)."""
    mode = tool_mode(tools, tool_choice)
    if mode == "named":
        return parameters_of(tools or [], named_function(tool_choice) or "")
    if mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters", EMPTY_PARAMETERS),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools or []
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema

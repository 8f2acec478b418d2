"""Structured outputs on the wire: vLLM's `structured_outputs` and OpenAI's `response_format`.

A job carries at most one constraint, as the engine's `StructuredOutputsParams` takes it:
``{"json": schema}``, ``{"regex": str}``, ``{"choice": [str, ...]}``, ``{"grammar": str}`` or
``{"json_object": true}``. OpenAI's `response_format` (`text`, `json_object`, `json_schema`) is
turned into one. Here only its shape and size are checked; the worker's engine compiles it, and
a constraint it cannot compile or enforce fails that job alone, naming the field.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# The constraint's JSON text at most: a schema past this is refused before any worker sees it.
MAX_STRUCTURED_CHARS = 64 * 1024
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def check_structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    """A `structured_outputs` object, checked for shape and size (ValueError says what is wrong)."""
    given = [k for k in value if value[k] is not None and value[k] is not False]
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}: allowed are {', '.join(KINDS)}")
    if len(given) != 1:
        raise ValueError(f"set exactly one of {', '.join(KINDS)}, got {given or 'none'}")
    kind, spec = given[0], value[given[0]]
    allowed = {
        "json": (dict | bool | str, "a JSON Schema (an object, a boolean, or its JSON text)"),
        "regex": (str, "a regular expression (a string)"),
        "choice": (list, "a non-empty list of strings"),
        "grammar": (str, "a Lark or GBNF grammar (a string)"),
        "json_object": (bool, "true"),
    }
    kind_type, what = allowed[kind]
    bad = not isinstance(spec, kind_type) or (
        kind == "choice" and not (spec and all(isinstance(c, str) for c in spec))
    )
    if bad:
        raise ValueError(f"{kind}: must be {what}, got {type(spec).__name__}")
    size = len(json.dumps(spec, ensure_ascii=False))
    if size > MAX_STRUCTURED_CHARS:
        raise ValueError(
            f"{kind}: must be at most {MAX_STRUCTURED_CHARS} characters of JSON, got {size}"
        )
    return {kind: spec}


def from_response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's `response_format` as a `structured_outputs` object (None for `text`)."""
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"type: must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        # Together's and Anyscale's form (instructor's JSON_SCHEMA mode sends it): a schema.
        schema = value.get("schema")
        if schema is not None:
            if not isinstance(schema, dict):
                raise ValueError(f"schema: must be an object, got {type(schema).__name__}")
            return check_structured_outputs({"json": schema})
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError('json_schema: must be {"name": str, "schema": {...}, "strict": bool}')
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema.schema: must be an object, got {type(schema).__name__}")
    return check_structured_outputs({"json": schema})

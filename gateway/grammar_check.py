"""Refuse, before enqueuing, an output constraint the workers' grammar engine would refuse.

With llguidance installed beside the gateway, its tokenizer-free check runs here (well under a
millisecond for a usual schema), so a bad schema, regex or grammar is a 400 naming the field
the client sent, not a failed job. Without it, the worker's refusal is mapped to the same 400
(`job_error`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from gateway.errors import APIError
from producer.openai_fields import constraint_param

try:
    import llguidance
    from llguidance import LLMatcher
except ImportError:  # the gateway installs without it; the workers then check
    llguidance = None

# The engine's JSON settings (engine/structured_outputs/grammar.py), which a check must share.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Past this the check may take milliseconds: the workers check it on their compile pool.
MAX_CHECK_CHARS = 16_384


def check_constraint(structured: dict[str, Any], body: dict[str, Any]) -> None:
    """APIError 400 when llguidance refuses `structured` (a `structured_outputs` object)."""
    if llguidance is None:
        return
    kind, spec = next(iter(structured.items()))
    text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
    if len(text) > MAX_CHECK_CHARS:
        return
    refusal = _refusal(kind, text)
    if refusal is not None:
        param = constraint_param(body)
        raise APIError(400, f"{param}: the grammar engine refuses it: {refusal}", param=param)


# A dataset's requests repeat one schema: each distinct one is checked once (1.7 ms measured
# for a small tool schema on the loaded 2-core host, 6.6 ms for a `required` choice of 5 tools;
# a repeat costs 0.07 ms, its JSON text and the look-up).
@functools.lru_cache(maxsize=1024)
def _refusal(kind: str, text: str) -> str | None:
    try:
        if kind in ("json", "json_object"):
            schema = text if kind == "json" else '{"type":"object"}'
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(
                json.loads(text) if text.startswith('"') else text
            )
        elif kind == "grammar":
            grammar = llguidance.grammar_from("grammar", text)
        else:
            return None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    except ValueError as exc:
        is_error, messages = True, [str(exc)]
    return "; ".join(messages)[:1000] if is_error else None

"""A constraint to llguidance's grammar text, and the checks that name the field at fault."""

from __future__ import annotations

import json

import llguidance
from llguidance import LLMatcher

from engine.structured_outputs.params import StructuredOutputsParams

# Compact JSON with the separators models write anyway (json.dumps' defaults). Flexible
# whitespace lets a small model loop on newlines until max_tokens, and fixed separators make
# `{"key": "` one forced run (no decode step). A schema's own "x-guidance" overrides these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = '{"type":"object"}'
# Past this, even the tokenizer-free check may take milliseconds (22 ms for a 64 KiB schema):
# it runs on the compile pool, not on the caller's thread.
MAX_SYNC_CHECK_CHARS = 16_384
# llguidance's run-time errors quote the whole grammar (the schema included): keep the head.
MAX_ERROR_CHARS = 1_000


class GrammarError(ValueError):
    """A constraint llguidance refuses; the message names the field (structured_outputs.json)."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        message = message.strip()
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + f"... ({len(message)} characters)"
        super().__init__(f"structured_outputs.{kind}: {message}")


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``params`` (not checked yet: see ``check``)."""
    kind = params.kind
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(params.spec, defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.spec)
        if kind == "choice":
            # Lark string literals take JSON's escapes, so each choice is matched exactly.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.grammar_from("grammar", params.spec)  # Lark, or GBNF converted
    except ValueError as e:
        raise GrammarError(kind, str(e)) from e


def check(params: StructuredOutputsParams, grammar: str, tokenizer=None) -> None:
    """Raise GrammarError with llguidance's words if ``grammar`` is invalid or only partly
    enforceable (strict mode: a JSON Schema keyword it cannot enforce is an error)."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(params.kind, "; ".join(messages))


def check_cheaply(params: StructuredOutputsParams) -> None:
    """The tokenizer-free check, where it costs well under a millisecond or two."""
    if len(params.spec) <= MAX_SYNC_CHECK_CHARS:
        check(params, grammar_text(params))

"""What a request asks its output to match: a JSON schema, a regex, a choice or a grammar."""

from __future__ import annotations

import hashlib
import json as _json
from dataclasses import dataclass, field

# The kinds, in the order error messages list them (vLLM's names).
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"structured_outputs.{name}={value!r:.200} is invalid: must be {allowed}")


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set (names follow vLLM).

    ``json``: a JSON Schema (a dict, or its JSON text); ``regex``: a regular expression the
    whole output matches; ``choice``: the output is one of these strings; ``grammar``: a Lark
    (or GBNF) grammar as llguidance takes it; ``json_object``: any JSON object.
    """

    json: dict | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The canonical text of the constraint, and (kind, digest): the key grammars are cached by.
    spec: str = field(init=False, default="", repr=False, compare=False)
    key: tuple[str, str] = field(init=False, default=("", ""), repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if self.json_object is False:
            given.remove("json_object")
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}: "
                f"got {', '.join(given) if given else 'none'}"
            )
        kind = given[0]
        self.spec = getattr(self, f"_check_{kind}")()
        digest = hashlib.blake2b(self.spec.encode(), digest_size=16).hexdigest()
        self.key = (kind, digest)

    @property
    def kind(self) -> str:
        """Which field is set: one of KINDS."""
        return self.key[0]

    def _check_json(self) -> str:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except ValueError as e:
                raise _bad("json", self.json, f"a JSON Schema; its text is not JSON ({e})") from e
        if not isinstance(schema, dict | bool):
            raise _bad("json", self.json, "a JSON Schema (an object or a boolean)")
        # Key order is kept: llguidance emits properties in the schema's order.
        return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)

    def _check_regex(self) -> str:
        if not isinstance(self.regex, str) or not self.regex:
            raise _bad("regex", self.regex, "a non-empty string (a regular expression)")
        return self.regex

    def _check_choice(self) -> str:
        choice = self.choice
        if (
            not isinstance(choice, list | tuple)
            or not choice
            or not all(isinstance(c, str) and c for c in choice)
        ):
            raise _bad("choice", choice, "a non-empty list of non-empty strings")
        self.choice = list(choice)
        return _json.dumps(self.choice, ensure_ascii=False)

    def _check_grammar(self) -> str:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise _bad("grammar", self.grammar, "a non-empty string (a Lark or GBNF grammar)")
        return self.grammar

    def _check_json_object(self) -> str:
        if self.json_object is not True:
            raise _bad("json_object", self.json_object, "True (or unset)")
        return "true"

    @classmethod
    def coerce(cls, value: object) -> StructuredOutputsParams | None:
        """``value`` as StructuredOutputsParams: itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS))
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown field(s) {unknown}: allowed are "
                    f"{', '.join(KINDS)}"
                )
            return cls(**value)
        raise ValueError(
            f"structured_outputs={value!r:.200} is invalid: must be a StructuredOutputsParams, "
            "a dict with one of " + ", ".join(KINDS) + ", or None"
        )

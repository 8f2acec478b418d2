"""What OpenAI clients send in a chat or completions body, as pagedq request fields.

Shared by the gateway's online endpoints and by batch lines (gateway and `pagedq submit`), so
a field means the same everywhere. Explicit JSON nulls mean "not given" (distilabel sends
`"stop": null`). Fields that change nothing here are accepted and dropped (ACCEPTED); vLLM's
older `guided_*` fields become `structured_outputs`; an `extra_body` object sent literally is
merged into the body, as the SDKs merge it; `reasoning_effort` goes to the chat template (gpt-oss
reads it). Anything else unknown is refused by GenerationRequest, by name.
"""

from __future__ import annotations

from typing import Any

# Bookkeeping and hints that do not change the output of an open model.
ACCEPTED = (
    "user",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
)
# vLLM's older names of structured_outputs' kinds.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's guided_decoding_backend picks an engine; pagedq has one (llguidance).
IGNORED_GUIDED = ("guided_decoding_backend",)


def openai_fields(body: dict[str, Any], url: str) -> dict[str, Any]:
    """The request fields of a body (a new dict); ValueError names a field given twice."""
    fields = {k: v for k, v in body.items() if v is not None and k != "extra_body"}
    extra = body.get("extra_body")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if value is not None:
                fields.setdefault(key, value)
    elif extra is not None:
        raise ValueError(f"extra_body: must be an object, got {type(extra).__name__}")
    for name in ACCEPTED + IGNORED_GUIDED:
        fields.pop(name, None)
    guided = {GUIDED[k]: fields.pop(k) for k in list(fields) if k in GUIDED}
    if guided:
        given = [k for k in GUIDED if k in body or k in (extra or {})]
        if "structured_outputs" in fields or "response_format" in fields or len(guided) > 1:
            raise ValueError(
                f"{given[0]}: give one of {', '.join(given)}, structured_outputs or "
                "response_format, not several"
            )
        fields["structured_outputs"] = guided
    effort = fields.pop("reasoning_effort", None)
    if effort is not None:
        if url != "/v1/chat/completions":
            raise ValueError("reasoning_effort: only chat completions take it")
        kwargs = fields.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("chat_template_kwargs: must be an object")
        fields["chat_template_kwargs"] = {"reasoning_effort": effort, **(kwargs or {})}
    return fields


def constraint_param(body: dict[str, Any]) -> str:
    """The field a request's output constraint came from, for errors that name it."""
    extra = body.get("extra_body") if isinstance(body.get("extra_body"), dict) else {}
    for name in ("tool_choice", "response_format", "structured_outputs", *GUIDED):
        if body.get(name) is not None or extra.get(name) is not None:
            if name == "tool_choice" and body.get(name) in ("auto", "none"):
                continue
            return name
    return "structured_outputs"

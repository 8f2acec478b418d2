"""Tool-call parsers: the calls a model wrote in its family's own format, for `tool_choice: auto`.

Named as vLLM names them: `hermes` (Hermes, Qwen2.5/Qwen3: `<tool_call>{"name", "arguments"}
</tool_call>`), `llama3_json` (Llama 3.1+: a JSON object `{"name", "parameters"}`, maybe after
`<|python_tag|>`, several joined by `;`), `mistral` (`[TOOL_CALLS]` then a JSON array, or
`name[ARGS]{...}` in newer tokenizers) and `openai` (gpt-oss's harmony messages addressed
`to=functions.NAME`). Each gives the content before the calls and the calls, each as a name
and its arguments' JSON text; text that is not a well-formed call stays content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from producer.reasoning import HARMONY_MESSAGE, hold_back

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "openai")
# Where each format's calls begin: content is streamed up to the first of these.
CALL_STARTS = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>", "{"),
    "mistral": ("[TOOL_CALLS]",),
    "openai": ("to=functions.",),
}
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
MISTRAL_NAMED_CALL = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedTools:
    """What a tool-call parser found: the content (None when only calls) and the calls."""

    content: str | None
    calls: list[ParsedCall]


def parse_tool_calls(parser: str | None, text: str) -> ParsedTools:
    """The calls in a whole answer (`parser` None, or no calls found: all content)."""
    parse = {
        "hermes": _hermes,
        "llama3_json": _llama3_json,
        "mistral": _mistral,
        "openai": _harmony,
    }.get(parser or "")
    found = parse(text) if parse is not None else None
    return found if found is not None and found.calls else ParsedTools(text, [])


def content_before_calls(parser: str | None, text: str) -> str:
    """The part of a stream's text so far that is surely content (not the start of a call)."""
    starts = CALL_STARTS.get(parser or "", ())
    if parser == "llama3_json":
        return "" if text.lstrip()[:1] in ("{", "<", "") else text
    cut = min((i for i in (text.find(s) for s in starts) if i >= 0), default=len(text))
    return hold_back(text[:cut], *starts)


def _call(obj: object, args_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _content(text: str) -> str | None:
    return text.strip() or None


def _hermes(text: str) -> ParsedTools | None:
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls = [_call(_loads(m.group(1))) for m in HERMES_CALL.finditer(text, start)]
    if not calls or None in calls:
        return None
    return ParsedTools(_content(text[:start]), calls)


def _llama3_json(text: str) -> ParsedTools | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        calls.append(_call(obj, "parameters"))
        pos = end
        while pos < len(body) and body[pos] in "; \n\t":
            pos += 1
    if not calls or None in calls:
        return None
    return ParsedTools(None, calls)


def _mistral(text: str) -> ParsedTools | None:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    rest = text[start:].replace("[TOOL_CALLS]", "").strip()
    if rest.startswith("["):
        parsed = _loads(rest)
        calls = [_call(c) for c in parsed] if isinstance(parsed, list) else [None]
    else:  # newer tokenizers: name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        calls, decoder = [], json.JSONDecoder()
        for match in MISTRAL_NAMED_CALL.finditer(rest):
            try:
                args, _ = decoder.raw_decode(rest, match.end())
            except ValueError:
                return None
            calls.append(ParsedCall(match.group(1), json.dumps(args, ensure_ascii=False)))
    if not calls or None in calls:
        return None
    return ParsedTools(_content(text[:start]), calls)


def _harmony(text: str) -> ParsedTools | None:
    calls, content = [], []
    for message in HARMONY_MESSAGE.finditer(text):
        header, body = message["header"], message["body"]
        recipient = re.search(r"to=functions\.([A-Za-z0-9_.-]+)", header)
        if recipient is None:
            if "final" in header:
                content.append(body)
            continue
        args = _loads(body.strip())
        if args is None:
            return None
        calls.append(ParsedCall(recipient.group(1), json.dumps(args, ensure_ascii=False)))
    return ParsedTools(_content("".join(content)), calls)

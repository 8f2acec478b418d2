"""Reasoning parsers: a thinking model's answer cut into its thinking and its content.

One parser per family, named as vLLM names them: `qwen3` and `deepseek_r1` (`<think>...</think>`;
Qwen3 answers without a think block when thinking is off, so text without `</think>` is content
there, and thinking cut short by max_tokens for DeepSeek-R1, whose prompt opens the block) and
`openai_gptoss` (gpt-oss's harmony channels: `analysis` is the thinking, `final` the content).
Used by chat answers (`reasoning_content`), streams and batch output files, and by the
Responses API's `reasoning` item. `think_grammar` makes a structured output constrain the
answer after the thinking, not the thinking.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
# Harmony's message header and body markers (gpt-oss); the body ends at any of ENDS.
HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>)?(?P<header>[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?)"
    r"<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)",
    re.DOTALL,
)
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>")


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """The thinking (None when there was none) and the content of an answer."""

    reasoning: str | None
    content: str


def split_reasoning(parser: str | None, text: str) -> ReasoningSplit:
    """Cut a whole answer (or the text so far of a stream) by `parser` (None: all content)."""
    if parser in ("qwen3", "deepseek_r1"):
        return _split_think(text, open_by_default=parser == "deepseek_r1")
    if parser == "openai_gptoss":
        return _split_harmony(text)
    return ReasoningSplit(None, text)


def _split_think(text: str, open_by_default: bool) -> ReasoningSplit:
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_START)
    if opened:
        stripped = stripped[len(THINK_START) :]
    end = stripped.find(THINK_END)
    if end >= 0:
        content = stripped[end + len(THINK_END) :].lstrip()
        return ReasoningSplit(stripped[:end].strip(), content)
    if opened or open_by_default:
        return ReasoningSplit(_hold_back(stripped, THINK_END).strip(), "")
    return ReasoningSplit(None, text)


def _split_harmony(text: str) -> ReasoningSplit:
    if "<|message|>" not in text:
        return ReasoningSplit(None, "" if "<|" in text else text)
    reasoning, content = [], []
    for message in HARMONY_MESSAGE.finditer(text):
        header, body = message["header"], _hold_back(message["body"], *HARMONY_MARKERS)
        if "to=" in header:
            continue  # a tool call: producer/tool_parsers.py reads it
        if "analysis" in header:
            reasoning.append(body)
        elif "final" in header or "commentary" in header:
            content.append(body)
    return ReasoningSplit("".join(reasoning) if reasoning else None, "".join(content))


def _hold_back(text: str, *markers: str) -> str:
    """`text` without a tail that may be the start of a marker (a stream's partial text)."""
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                return text[:-n]
    return text


def hold_back(text: str, *markers: str) -> str:
    """`text` without a tail that may be the start of one of `markers` (for streams)."""
    return _hold_back(text, *markers)


def thinks(parser: str | None, chat_template_kwargs: dict | None) -> bool:
    """True when the answer begins with thinking the structured output must let through."""
    if parser not in ("qwen3", "deepseek_r1"):
        return False
    return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


def think_grammar(structured: dict, json_defaults: dict) -> dict | None:
    """A Lark grammar (llguidance's) of a think block, then what `structured` asks for; None
    for a regex or grammar constraint (those constrain the whole output, thinking excluded).

    The think block is one lexeme: text up to the first `</think>` (the block's `<think>` may
    be in the prompt already), so the lexer never has to end it early.
    """
    think = (
        "THINK: /(?s:(<think>)?.*<\\/think>)/ & ~/(?s:.*<\\/think>.+)/\n"
        "start: THINK /[ \\n]{0,4}/ answer\n"
    )
    if "json" in structured or "json_object" in structured:
        schema = structured.get("json")
        if schema is None or schema is True:
            schema = {"type": "object"}
        if isinstance(schema, str):
            schema = json.loads(schema)
        schema = {**schema, "x-guidance": {**json_defaults, **schema.get("x-guidance", {})}}
        return {"grammar": think + "answer: %json " + json.dumps(schema)}
    if "choice" in structured:
        choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in structured["choice"])
        return {"grammar": think + "answer: " + choices}
    return None

"""Which reasoning and tool-call formats a model's chat template speaks (vLLM's parser names).

Read once from the template's text; published in the worker's status (`config`) and carried in
every result, so the gateway and the batch output files cut answers by the model that ran them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Formats whose markers are special tokens: the text must keep them to be parsed.
NEEDS_SPECIAL_TOKENS = ("openai", "mistral")


@dataclass(frozen=True, slots=True)
class TemplateFormats:
    """The parsers of one chat template (None: the template speaks no such format)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        """True when answers must be decoded with their special tokens (gpt-oss, Mistral)."""
        return self.tool_call_parser in NEEDS_SPECIAL_TOKENS

    def summary(self) -> dict[str, str]:
        """The status fields (only the formats found)."""
        found = {"tool_call_parser": self.tool_call_parser}
        found["reasoning_parser"] = self.reasoning_parser
        return {k: v for k, v in found.items() if v is not None}


def template_formats(tokenizer: Any) -> TemplateFormats:
    """The formats of `tokenizer`'s chat template(s)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    return formats_of(str(template))


def formats_of(template: str) -> TemplateFormats:
    """The formats a chat template's text speaks."""
    if "<|channel|>" in template:
        return TemplateFormats("openai", "openai_gptoss")
    tool = None
    if "<tool_call>" in template:
        tool = "hermes"
    elif "[TOOL_CALLS]" in template:
        tool = "mistral"
    elif "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        tool = "llama3_json"
    reasoning = None
    if "</think>" in template:
        reasoning = "qwen3" if "enable_thinking" in template else "deepseek_r1"
    return TemplateFormats(tool, reasoning)

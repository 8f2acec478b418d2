"""Prompts into token ids: text, token ids or chat messages, checked against the model.

One place for what `LLM.generate`, `LLM.chat` and a worker's tokenizer thread all do; each
thread that tokenizes holds its own `PromptProcessor` (`copy()`), since fast tokenizers are
not safe to share between threads.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages with what else the chat template takes: function `tools` (OpenAI's
    [{"type": "function", "function": {...}}]) and keyword arguments such as enable_thinking."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


Prompt = str | list[int] | list[dict[str, Any]] | ChatPrompt
"""A text, a list of token ids, or chat messages ([{"role", "content"}], templated)."""


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A checked prompt: its text (None for token ids and chats) and its token ids."""

    text: str | None
    token_ids: list[int]


class PromptProcessor:
    """Tokenizes and templates prompts, refusing what the model cannot take (ValueError)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def copy(self) -> PromptProcessor:
        """A processor with its own copy of the tokenizer, for another thread."""
        try:
            tokenizer = copy.deepcopy(self.tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared as is
            tokenizer = self.tokenizer
        return PromptProcessor(tokenizer, self.vocab_size, self.max_model_len)

    def process(self, prompt: Prompt | ProcessedPrompt) -> ProcessedPrompt:
        """The checked token ids of a prompt; ValueError names the field and what is allowed."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, ChatPrompt):
            text = None
            token_ids = self.apply_chat_template(
                prompt.messages, prompt.tools, prompt.chat_template_kwargs
            )
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        elif (
            isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt)
        ):
            text, token_ids = None, self.apply_chat_template(list(prompt))
        elif isinstance(prompt, list | tuple) and all(_is_token_id(t) for t in prompt):
            text, token_ids = None, list(prompt)
            self._check_vocab(token_ids)
        else:
            raise ValueError(
                "prompt must be a string, a list of token ids or a list of chat messages"
            )
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: must be shorter than max_model_len={self.max_model_len}, "
                f"got {len(token_ids)} tokens"
            )
        return ProcessedPrompt(text, token_ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat, with the model's template and the generation prompt; `tools`
        and `chat_template_kwargs` go to the template as transformers passes them."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {role, content}")
        kwargs = dict(chat_template_kwargs or {})
        for reserved in ("messages", "conversation", "tools", "tokenize", "add_generation_prompt"):
            if reserved in kwargs:
                raise ValueError(f"chat_template_kwargs: {reserved!r} may not be set there")
        try:
            ids = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in messages],
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                **kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception, or a bad kwarg
            if isinstance(exc, ValueError) and "chat_template_kwargs" in str(exc):
                raise
            raise ValueError(f"messages: the chat template refused them: {exc}") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _check_vocab(self, token_ids: list[int]) -> None:
        negative = [t for t in token_ids if t < 0]
        if negative:
            raise ValueError(f"prompt: token ids must be >= 0, got {negative[:3]}")
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt: must be token ids < vocab size {self.vocab_size}, got {bad[:3]}"
            )


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: a tool call's `arguments` as an object (OpenAI
    sends its JSON text; templates such as Llama 3.1's write it with `tojson`)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return {**message, "tool_calls": out}


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

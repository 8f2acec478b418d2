"""Prompts into token ids: text, token ids or chat messages, checked against the model.

One place for what `LLM.generate`, `LLM.chat` and a worker's tokenizer thread all do; each
thread that tokenizes holds its own `PromptProcessor` (`copy()`), since fast tokenizers are
not safe to share between threads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

Prompt = str | list[int] | list[dict[str, Any]]
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
        if isinstance(prompt, str):
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

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat, with the model's template and the generation prompt."""
        if not messages:
            raise ValueError("messages must be a non-empty list of {role, content}")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
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


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""Incremental detokenization with stop strings, safe to stream."""

from __future__ import annotations

# Tokens of context decoded before the new ones, so that tokenizers which drop a leading
# space at the start of a decode still produce the right text.
_CONTEXT_TOKENS = 5


def raw_decode(tokenizer):
    """The Rust tokenizer's own ``decode(ids, skip_special_tokens=)`` where transformers' adds
    nothing to it (a fast tokenizer without ``clean_up_tokenization_spaces``), else the
    tokenizer's: two decodes per token per request, and transformers' wrapper around each cost
    4x the decode itself (bench/peers.py's uniform workload: 0.7 ms of a 37 ms step)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    """Turns one request's growing token list into text, one small decode per token."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special: bool):
        self.tokenizer = tokenizer
        self._decode_ids = raw_decode(tokenizer)
        self.stop = stop
        self.skip_special = skip_special
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        # Text that might still become the start of a stop string is held back from streams.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special)

    def update(self, token_id: int) -> str | None:
        """Add one token; returns the stop string matched, if any (the text is cut before it)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        old_len = len(self.output_text)
        self.output_text += text[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> str | None:
        for stop in self.stop:
            start = max(0, old_len - len(stop) + 1)
            idx = self.output_text.find(stop, start)
            if idx != -1:
                self.output_text = self.output_text[:idx]
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: all of it once finished."""
        if finished or not self.holdback:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.holdback)]

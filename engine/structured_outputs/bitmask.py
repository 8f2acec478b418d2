"""One token bitmask per step for the constrained rows: filled beside the forward, applied
to the logits in one vectorized call."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.torch import fill_next_token_bitmask_par

_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarBitmask:
    """A reusable ``[rows, ceil(vocab / 32)]`` int32 buffer and the thread that fills it."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.buffer = torch.zeros(0, self.num_words, dtype=torch.int32)
        # llguidance drops the GIL while it fills, so the fill overlaps the model's forward.
        self._filler = ThreadPoolExecutor(1, "pagedq-bitmask")
        self._executor = LLExecutor(num_threads=1)
        self.overlap = True

    def start(self, matchers: list[LLMatcher]) -> Future | torch.Tensor:
        """Begin filling one row per matcher; ``finish`` returns the filled mask."""
        if self.buffer.shape[0] < len(matchers):
            self.buffer = torch.zeros(len(matchers), self.num_words, dtype=torch.int32)
        mask = self.buffer[: len(matchers)]
        if not self.overlap:
            return self._fill(matchers, mask)
        return self._filler.submit(self._fill, matchers, mask)

    @staticmethod
    def finish(pending: Future | torch.Tensor) -> torch.Tensor:
        """The mask ``start`` began."""
        return pending.result() if isinstance(pending, Future) else pending

    def _fill(self, matchers: list[LLMatcher], mask: torch.Tensor) -> torch.Tensor:
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], mask)
        return mask

    def apply(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
        """Set to -inf, in place, every logit of ``rows`` the mask forbids."""
        vocab = logits.shape[1]
        words = min(self.num_words, -(-vocab // 32))
        allowed = ((mask[:, :words, None] >> _SHIFTS) & 1).bool().view(len(rows), -1)[:, :vocab]
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: the rest is never allowed
            pad = torch.zeros(len(rows), vocab - allowed.shape[1], dtype=torch.bool)
            allowed = torch.cat([allowed, pad], dim=1)
        allowed = allowed.to(logits.device, non_blocking=True)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

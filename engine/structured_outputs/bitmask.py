"""One token bitmask per step for the constrained rows: filled beside the forward, applied
to the logits in one vectorized call."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.torch import fill_next_token_bitmask_par

from kernels import apply_token_bitmask


class GrammarBitmask:
    """A reusable ``[rows, ceil(vocab / 32)]`` int32 buffer and the thread that fills it."""

    def __init__(self, vocab_size: int, backend: str = "auto") -> None:
        self.vocab_size = vocab_size
        self.backend = backend
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
        index = torch.tensor(rows, dtype=torch.long)
        apply_token_bitmask(logits, index, mask[: len(rows)], self.backend)

"""One sample's grammar state: its matcher, and the tokens it constrained or forced."""

from __future__ import annotations

import time
from concurrent.futures import Future

from llguidance import LLMatcher

from engine.structured_outputs.params import StructuredOutputsParams


class StructuredOutputRequest:
    """Attached to a Request as ``request.structured_output_request`` (vLLM's name).

    The matcher has consumed exactly the request's output tokens. Preemption never re-samples
    an output token (recompute only recomputes KV), so the state survives it as it is.
    """

    __slots__ = (
        "params",
        "grammar",
        "matcher",
        "held_since",
        "num_constrained_tokens",
        "num_forced_tokens",
    )

    def __init__(self, params: StructuredOutputsParams, grammar: Future) -> None:
        self.params = params
        self.grammar = grammar  # Future[CompiledGrammar]
        self.matcher: LLMatcher | None = None  # set once the grammar is compiled
        self.held_since = time.perf_counter()
        self.num_constrained_tokens = 0  # sampled under the mask
        self.num_forced_tokens = 0  # appended without a decode step

    @property
    def is_ready(self) -> bool:
        """True once the matcher exists (the request may be scheduled)."""
        return self.matcher is not None

    def accept(self, token_id: int) -> bool:
        """Advance over one token; False if the grammar refuses it (the matcher is in error)."""
        return self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: no token but EOS could follow."""
        return self.matcher.is_stopped()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation, as the tokenizer would write
        them (llguidance holds back bytes whose tokenization the next token could change)."""
        return self.matcher.compute_ff_tokens()

    @property
    def error(self) -> str:
        """The matcher's error, if it is in one."""
        return self.matcher.get_error()

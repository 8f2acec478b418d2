"""What the engine returns: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt, cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # Tokens a grammar forced (appended without a decode step; see docs/STRUCTURED_OUTPUTS.md).
    num_forced_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True once this sample ended."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one prompt's request after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))


@dataclass(slots=True)
class EmbeddingOutput:
    """The pooled vector of one input (vLLM's name)."""

    index: int
    embedding: list[float]
    num_prompt_tokens: int


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """An embedding request's vectors, one per input; given once, when every input is done."""

    request_id: str
    prompt_token_ids: list[int]  # of the first input
    outputs: list[EmbeddingOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens over every input."""
        return sum(o.num_prompt_tokens for o in self.outputs)

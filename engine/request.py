"""A request as the scheduler sees it: tokens, progress and the blocks it holds."""

from __future__ import annotations

import enum
import time

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Life cycle of a request inside the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # by recompute: back in the waiting queue, KV dropped
    SWAPPED = "swapped"  # by swap: KV in the host swap pool, num_computed_tokens kept
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        """True for every finished state."""
        return self.value.startswith("finished")


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence. No prefill/decode phases: each step computes its uncomputed tokens."""

    __slots__ = (
        "request_id",
        "parent_id",
        "sample_index",
        "prompt",
        "prompt_token_ids",
        "params",
        "priority",
        "tenant",
        "arrival_time",
        "status",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_hashes",
        "num_preemptions",
        "stop_reason",
        "first_scheduled_time",
        "first_token_time",
        "finished_time",
        "logprobs",
        "cumulative_logprob",
        "generator",
        "structured_output_request",
        "pooling",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
        tenant: str | None = None,
        pooling=None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.sample_index = sample_index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.generator = None  # a torch.Generator, made by the sampler for seeded requests
        # Its grammar's state (engine.structured_outputs.matcher), when the output is constrained.
        self.structured_output_request = None
        # An embedding request's engine.pooling.PoolingState: it ends after its prefill.
        self.pooling = pooling

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute at most: the uncomputed ones plus the outputs not sampled yet."""
        return (self.num_tokens - self.num_computed_tokens) + (
            self.params.max_tokens - self.num_output_tokens
        )

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

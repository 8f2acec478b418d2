"""Per-job limits a worker enforces before the engine sees a job, with their defaults."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PAYLOAD_BYTES = 2**20


@dataclass(slots=True, frozen=True)
class JobLimits:
    """What one job may ask of this worker. The wire schema's hard limits (producer/schema.py)
    are looser; these are the worker's own, meant to be set by flags.

    - ``max_n``: completions per job (``n``).
    - ``max_payload_bytes``: the job's JSON data once inflated (RQ stores it zlib-compressed);
      checked before any JSON parsing, so it also bounds tokenization work.
    - ``max_stop``, ``max_stop_token_ids``: stop strings and stop token ids per job.
    - ``max_tokens``: a cap applied to each job's ``max_tokens`` (None: no cap but the
      context; a generation always ends at the model's ``max_model_len`` with "length").
    - ``max_logprobs``: top log-probabilities per token.
    """

    max_n: int = 16
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_stop: int = 16
    max_stop_token_ids: int = 64
    max_tokens: int | None = None
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for name in ("max_n", "max_payload_bytes", "max_stop", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} is invalid: must be >= 1 or None")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs={self.max_logprobs} is invalid: must be in [0, 20]")


@dataclass(slots=True, frozen=True)
class ModelLimits:
    """The served model's real limits: token ids must be < ``vocab_size``, a sequence at most
    ``max_model_len`` tokens."""

    vocab_size: int
    max_model_len: int

    @classmethod
    def from_engine(cls, engine) -> ModelLimits:
        """The limits of a loaded `LLMEngine`."""
        return cls(engine.hf_config.vocab_size, engine.max_model_len)

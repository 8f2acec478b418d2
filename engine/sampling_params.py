"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one prompt's completions (names and defaults follow vLLM).

    ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those filters off.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 256
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "an integer >= 0 (0 disables it)",
        )
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            self.presence_penalty,
            "in [-2, 2]",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            self.frequency_penalty,
            "in [-2, 2]",
        )
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            self.logprobs,
            "None or an integer in [0, 20]",
        )
        _check(
            self.seed is None or isinstance(self.seed, int), "seed", self.seed, "None or an integer"
        )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(
            all(isinstance(s, str) and s for s in stop),
            "stop",
            self.stop,
            "a non-empty string or a list of non-empty strings",
        )
        self.stop_strings = stop
        ids = list(self.stop_token_ids or [])
        _check(
            all(isinstance(t, int) and t >= 0 for t in ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a list of token ids >= 0",
        )
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` samples: n=1, and its own seed."""
        seed = None if self.seed is None else self.seed + index
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "stop_strings"}
        return SamplingParams(**{**fields, "n": 1, "seed": seed})

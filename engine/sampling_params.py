"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured_outputs.params import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Past these the sampler would overflow int64 tensors or the engine would never finish a request.
MAX_N = 1024
MAX_LOGPROBS = 20


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bias(value: object) -> bool:
    return _is_real(value) and -100 <= value <= 100


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    _check(_is_int(value) and lo <= value <= hi, name, value, f"an integer in [{lo}, {hi}]")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one prompt's completions (names and defaults follow vLLM).

    ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` switch those filters off. A
    ``top_k`` above the vocabulary is the same as 0. Every value the sampler could not use
    (non-finite floats, bools for numbers, integers past 64 bits) is refused here.
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
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling.
    logit_bias: dict[int, float] | None = None
    # A JSON schema, regex, choice or grammar the output must match (dicts are converted).
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        _int_in("n", self.n, 1, MAX_N)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value), name, value, "a finite number")
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _int_in("top_k", self.top_k, 0, INT64_MAX)
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
        _check(
            _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0",
        )
        _int_in("max_tokens", self.max_tokens, 1, INT64_MAX)
        _int_in("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            # Sample k of n is seeded with seed + k: that must stay inside torch's 64-bit range.
            _int_in("seed", self.seed, INT64_MIN, INT64_MAX - MAX_N)
        for name in ("ignore_eos", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "a boolean")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        _check(
            isinstance(stop, list | tuple) and all(isinstance(s, str) and s for s in stop),
            "stop",
            self.stop,
            "a non-empty string or a list of non-empty strings",
        )
        self.stop_strings = list(stop)
        ids = self.stop_token_ids or []
        _check(
            isinstance(ids, list | tuple) and all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids),
            "stop_token_ids",
            self.stop_token_ids,
            f"a list of token ids in [0, {INT64_MAX}]",
        )
        self.stop_token_ids = list(ids)
        bias = self.logit_bias or {}
        _check(
            isinstance(bias, dict)
            and all(_is_int(t) and t >= 0 and _bias(b) for t, b in bias.items()),
            "logit_bias",
            self.logit_bias,
            "a mapping of token ids to biases in [-100, 100]",
        )
        self.logit_bias = dict(bias) or None
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` samples: n=1, and its own seed."""
        seed = None if self.seed is None else self.seed + index
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "stop_strings"}
        return SamplingParams(**{**fields, "n": 1, "seed": seed})

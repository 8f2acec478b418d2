"""The wire schema of a job and of its result (pydantic v2), shared by producer and worker.

`SAMPLING_FIELDS` names the request fields that are the engine's `SamplingParams` keywords
(same names, same defaults); tests/test_contract.py checks the two against each other.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from producer.contract.embeddings import check_embed_request
from producer.contract.routing import TENANT_RE
from producer.contract.structured import check_structured_outputs, from_response_format
from producer.errors import InvalidRequestError

__all__ = [
    "SAMPLING_FIELDS",
    "ChatMessage",
    "Choice",
    "GenerationRequest",
    "GenerationResult",
    "Timings",
    "Usage",
    "format_validation_error",
]

ROLES = ("system", "developer", "user", "assistant", "tool")
JobStatus = Literal["finished", "failed", "canceled"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Hard limits of the wire schema: past them no worker could run the job. A worker applies its
# own, lower limits too (worker/limits.py, `JobLimits`): e.g. n <= 16 and a 1 MiB payload.
MAX_N = 128
MAX_TOKENS = 1_048_576
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPT_CHARS = 8 * 2**20
MAX_PROMPT_TOKENS = 2**20
MAX_MESSAGES = 4096
MAX_ID_CHARS = 512
# The seed of sample k of n is seed + k, which must stay a 64-bit integer.
MAX_SEED = INT64_MAX - 1024

# field -> (low, low_inclusive, high, high_inclusive); None = unbounded on that side.
RANGES: dict[str, tuple[float | None, bool, float | None, bool]] = {
    "n": (1, True, None, False),
    "temperature": (0, True, None, False),
    "top_p": (0, False, 1, True),
    "top_k": (0, True, None, False),
    "min_p": (0, True, 1, True),
    "presence_penalty": (-2, True, 2, True),
    "frequency_penalty": (-2, True, 2, True),
    "repetition_penalty": (0, False, None, False),
    "max_tokens": (1, True, None, False),
    "min_tokens": (0, True, None, False),
    "logprobs": (0, True, 20, True),
    "seed": (INT64_MIN, True, MAX_SEED, True),
    "priority": (INT64_MIN, True, INT64_MAX, True),
}
# The GenerationRequest fields that are also SamplingParams keywords (same names, same defaults).
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "structured_outputs",
)
# Upper limits of otherwise one-sided ranges: sizes no worker could serve.
CAPS = {"n": MAX_N, "top_k": INT64_MAX, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS}
# Errors quote at most this much of a refused value (a refused prompt can be megabytes).
MAX_QUOTED_CHARS = 80


def _allowed(lo: float | None, lo_inc: bool, hi: float | None, hi_inc: bool) -> str:
    if hi is None:
        return f"{'>=' if lo_inc else '>'} {lo}"
    if lo is None:
        return f"{'<=' if hi_inc else '<'} {hi}"
    return f"in {'[' if lo_inc else '('}{lo}, {hi}{']' if hi_inc else ')'}"


def _check_token_ids(ids: list[int]) -> None:
    bad = [t for t in ids if not 0 <= t <= MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}], got {_quote(bad[:3])}")


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else text[: MAX_QUOTED_CHARS - 3] + "..."


class ChatMessage(BaseModel):
    """One chat turn; OpenAI-style content parts [{"type": "text", "text": ...}] are joined."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v: Any) -> Any:
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
                raise ValueError('only {"type": "text", "text": ...} content parts are allowed')
            return "".join(p["text"] for p in v)
        return v


class GenerationRequest(BaseModel):
    """A job: `prompt` (text or token ids) or chat `messages`, plus the engine's sampling fields.

    Types are strict (no "16" or 16.0 for an int, no bool for a number), floats must be finite
    and every size is bounded (see the MAX_* constants).
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
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
    priority: int = 0
    custom_id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    metadata: dict[str, Any] | None = None
    model: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    tenant: str | None = None
    # At most one constraint on the output (producer/contract/structured.py); OpenAI's
    # response_format is turned into structured_outputs as it is parsed.
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # Write token entries to the job's stream as they come (someone reads them); without it
    # the stream gets only the final entry.
    stream: bool = False
    # The embedding job kind (producer/contract/embeddings.py): None is a generation.
    task: Literal["embed"] | None = None
    input: list[str | list[int]] | None = None
    dimensions: int | None = None

    @field_validator(*RANGES)
    @classmethod
    def _in_range(cls, v: float | None, info: Any) -> float | None:
        if v is None:
            return v
        lo, lo_inc, hi, hi_inc = RANGES[info.field_name]
        too_low = lo is not None and (v < lo if lo_inc else v <= lo)
        too_high = hi is not None and (v > hi if hi_inc else v >= hi)
        if too_low or too_high or (isinstance(v, float) and not math.isfinite(v)):
            raise ValueError(f"must be {_allowed(lo, lo_inc, hi, hi_inc)}, got {v!r}")
        cap = CAPS.get(info.field_name)
        if cap is not None and v > cap:
            raise ValueError(f"must be <= {cap}, got {v!r}")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: str | list[int] | None) -> str | list[int] | None:
        if v is not None and len(v) == 0:
            raise ValueError("must not be empty")
        if isinstance(v, str) and len(v) > MAX_PROMPT_CHARS:
            raise ValueError(f"must be at most {MAX_PROMPT_CHARS} characters, got {len(v)}")
        if isinstance(v, list):
            if len(v) > MAX_PROMPT_TOKENS:
                raise ValueError(f"must be at most {MAX_PROMPT_TOKENS} token ids, got {len(v)}")
            _check_token_ids(v)
        return v

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if v is not None and len(v) == 0:
            raise ValueError("must hold at least one message")
        if v is not None and len(v) > MAX_MESSAGES:
            raise ValueError(f"must hold at most {MAX_MESSAGES} messages, got {len(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_CHARS} characters, got {longest}"
            )
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_valid(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if len(v) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(v)}")
            _check_token_ids(v)
        return v

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str | None) -> str | None:
        if v is not None and not TENANT_RE.match(v):
            raise ValueError(f"must be 1 to 64 letters, digits, '_', '.' or '-', got {v[:80]!r}")
        return v

    @field_validator("custom_id")
    @classmethod
    def _custom_id_not_empty(cls, v: str | None) -> str | None:
        if v is not None and v == "":
            raise ValueError("must not be empty (omit it for a random job id)")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured_shape(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else check_structured_outputs(v)

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from_response_format(v)
        return v

    @model_validator(mode="after")
    def _check_combination(self) -> GenerationRequest:
        if self.task is not None or self.input is not None or self.dimensions is not None:
            if self.task is None:
                raise ValueError("input and dimensions belong to embedding jobs (task 'embed')")
            check_embed_request(self)
            return self
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.response_format is not None:
            if self.structured_outputs is not None:
                raise ValueError("give response_format or structured_outputs, not both")
            # One field carries the constraint on the wire (and into the job id's digest).
            self.structured_outputs = from_response_format(self.response_format)
            self.response_format = None
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        return self

    @classmethod
    def parse(cls, data: dict[str, Any]) -> GenerationRequest:
        """Validate a dict, raising InvalidRequestError with a readable message on bad fields."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise InvalidRequestError(format_validation_error(exc), exc.errors()) from None

    def payload(self) -> dict[str, Any]:
        """The job's single RQ argument, as the contract fixes it."""
        return self.model_dump(mode="json", exclude_none=True)

    def sampling_kwargs(self, max_tokens_cap: int | None = None) -> dict[str, Any]:
        """The engine's SamplingParams keywords, `max_tokens` (and `min_tokens`) capped."""
        kwargs = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        if max_tokens_cap is not None:
            kwargs["max_tokens"] = min(kwargs["max_tokens"], max_tokens_cap)
            kwargs["min_tokens"] = min(kwargs["min_tokens"], kwargs["max_tokens"])
        return kwargs


def format_validation_error(exc: ValidationError) -> str:
    """One line per refused field: `field: what is wrong (allowed values)`."""
    fields = ", ".join(GenerationRequest.model_fields)
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {fields})"
        elif err["type"] == "missing":
            msg = "field required"
        elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
            msg = f"{msg}, got {_quote(err['input'])}"
        lines.append(f"{loc}: {msg}")
    return "invalid request: " + "; ".join(lines)


class Usage(BaseModel):
    """Token counts of a finished job; `forced_tokens` of the completion tokens were appended by
    a structured output's grammar without a decode step of their own."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    forced_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """prompt_tokens + completion_tokens, as OpenAI reports it."""
        return self.prompt_tokens + self.completion_tokens


class Timings(BaseModel):
    """Seconds spent queued, to first token, and from enqueue to the end."""

    queued_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


class Choice(BaseModel):
    """One of the n completions of a job."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    # The text of each token id in `logprobs` (tokenizer.decode([id])), for OpenAI's `token`.
    token_texts: dict[int, str] | None = None


class GenerationResult(BaseModel):
    """What a worker writes back for a job (`pagedq:result:{job_id}` and RQ's return value)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    custom_id: str | None = None
    status: JobStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    token_texts: dict[int, str] | None = None
    choices: list[Choice] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    model: str | None = None
    worker: str | None = None
    error: str | None = None
    metadata: dict[str, Any] | None = None
    # An embedding job's vectors, one per input, in input order.
    embeddings: list[list[float]] | None = None

    def all_choices(self) -> list[Choice]:
        """`choices`, or the top-level fields as the single choice 0 when n == 1."""
        if self.choices:
            return self.choices
        return [
            Choice(
                text=self.text,
                token_ids=self.token_ids,
                finish_reason=self.finish_reason,
                logprobs=self.logprobs,
                token_texts=self.token_texts,
            )
        ]

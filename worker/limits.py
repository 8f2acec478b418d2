"""Per-job limits a worker enforces before the engine sees a job, with their defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_PAYLOAD_BYTES = 2**20


def _doc(text: str) -> dict[str, Any]:
    return {"help": text}


@dataclass(slots=True, frozen=True)
class JobLimits:
    """What one job may ask of this worker (its `pagedq worker` flags). The wire schema's hard
    limits (producer/contract/schema.py) are looser; the model's own (vocabulary, context) are
    the engine's to check."""

    max_n: int = field(default=16, metadata=_doc("completions per job (`n`) at most"))
    max_payload_bytes: int = field(
        default=DEFAULT_MAX_PAYLOAD_BYTES,
        metadata=_doc(
            "largest job data once inflated, checked before any JSON parsing "
            "(a zlib bomb stops there)"
        ),
    )
    max_stop: int = field(default=16, metadata=_doc("stop strings per job at most"))
    max_stop_token_ids: int = field(default=64, metadata=_doc("stop token ids per job at most"))
    max_tokens: int | None = field(
        default=None,
        metadata=_doc(
            "cap on each job's `max_tokens` (`min_tokens` with it); none: only the context "
            "limits a generation"
        ),
    )
    max_logprobs: int = field(
        default=20, metadata=_doc("top log-probabilities per token at most (0-20)")
    )

    def __post_init__(self) -> None:
        for name in ("max_n", "max_payload_bytes", "max_stop", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} is invalid: must be >= 1 or None")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs={self.max_logprobs} is invalid: must be in [0, 20]")

    def violation(self, request: Any) -> str | None:
        """What a schema-valid request asks beyond these limits ("field: must be ..."), or None."""
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        stop_ids = request.stop_token_ids or []
        checks = [
            ("n", request.n, request.n <= self.max_n, f"<= {self.max_n} (this worker's max_n)"),
            (
                "logprobs",
                request.logprobs,
                request.logprobs is None or request.logprobs <= self.max_logprobs,
                f"<= {self.max_logprobs}",
            ),
            (
                "stop",
                f"{len(stops)} strings",
                len(stops) <= self.max_stop,
                f"at most {self.max_stop} strings",
            ),
            (
                "stop_token_ids",
                f"{len(stop_ids)} ids",
                len(stop_ids) <= self.max_stop_token_ids,
                f"at most {self.max_stop_token_ids} ids",
            ),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                text = repr(value)
                text = text if len(text) <= 80 else text[:77] + "..."
                return f"invalid request: {name}: must be {allowed}, got {text}"
        return None

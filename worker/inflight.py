"""One started job as the worker tracks it while its request is in the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from producer.schema import GenerationRequest
from worker.rq_adapter import Claim
from worker.streams import StreamState


@dataclass(slots=True)
class InFlight:
    """A held job: its claim (lease and fencing token), request, stream and timing state."""

    claim: Claim
    request: GenerationRequest | None
    stream: StreamState
    enqueued_at: float
    started_at: float
    deadline: float  # monotonic time at which the job fails with "timeout"
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens_seen: int = 0
    last_output: Any = field(default=None)

    @property
    def job_id(self) -> str:
        """The RQ job id (also the engine's request id)."""
        return self.claim.job_id

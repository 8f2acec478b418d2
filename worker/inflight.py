"""One started job as the worker tracks it while its request is in the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from producer.schema import GenerationRequest
from worker.streams import StreamState


@dataclass(slots=True)
class InFlight:
    """A started job: its RQ objects, its request and its stream and timing state."""

    job: Job
    queue: Queue
    execution: Execution
    request: GenerationRequest
    stream: StreamState
    enqueued_at: float
    started_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens_seen: int = 0
    last_output: Any = field(default=None)

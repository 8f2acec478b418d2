"""One started job as the worker holds it while its request is in the engine, and what this run
of it has streamed (one entry per engine step, a restart entry first for a re-run)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from producer.contract.schema import GenerationRequest
from worker.claim import Claim

RESTART_ENTRY = {"event": "restart"}
"""First entry of a re-run: readers drop what they read before it and start over."""


@dataclass(slots=True)
class StreamState:
    """What this run of a job has streamed: its text and its number of tokens.

    Only a job that asked for it (`stream`) gets token entries, at most one every
    `interval_s` (the tokens between are coalesced into one entry); the others get only their
    final entry. A re-run (attempt > 1) starts with a pending restart entry, so the entries
    after the last restart always concatenate to the final result's text.
    """

    text: str = ""
    num_tokens: int = 0
    pending: list[dict[str, str]] = field(default_factory=list)
    ttl_set: bool = False
    enabled: bool = True
    interval_s: float = 0.0
    next_at: float = 0.0

    @classmethod
    def for_attempt(
        cls, attempt: int, enabled: bool = True, interval_s: float = 0.0
    ) -> StreamState:
        """The state of a new run: a re-run starts with the restart entry."""
        pending = [dict(RESTART_ENTRY)] if attempt > 1 and enabled else []
        return cls(pending=pending, enabled=enabled, interval_s=interval_s)

    def token_entry(self, completion: Any) -> dict[str, str] | None:
        """The entry for this step's new tokens of choice 0, or None when nothing is new."""
        new_ids = list(completion.token_ids[self.num_tokens :])
        if not new_ids:
            return None
        delta = completion.text[len(self.text) :]
        self.text = completion.text
        self.num_tokens += len(new_ids)
        return {"event": "token", "delta": delta, "token_ids": json.dumps(new_ids)}

    def take(
        self, completion: Any | None, now: float = 0.0, final: bool = False
    ) -> list[dict[str, str]]:
        """The entries to write this step: a pending restart, then the new tokens; nothing
        within `interval_s` of the last write unless `final` (the job ends with this step)."""
        if not self.enabled or (now < self.next_at and not final):
            return []
        self.next_at = now + self.interval_s
        entries, self.pending = self.pending, []
        if completion is not None:
            entry = self.token_entry(completion)
            if entry is not None:
                entries.append(entry)
        return entries


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

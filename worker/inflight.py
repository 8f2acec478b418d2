"""One started job as the worker holds it while its request is in the engine, and what this run
of it has streamed (one entry per stream window, a restart entry first for a re-run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from producer.contract.schema import GenerationRequest
from producer.contract.stream import restart_entry, token_entry
from worker.claim import Claim


@dataclass(slots=True)
class StreamState:
    """What this run of a job has written to its stream: its text and its number of tokens.

    Only a job that asked for it (`stream`) gets token entries; the others get only their
    final entry. When entries are written is the worker's `StreamWindow` (worker/coalesce.py):
    `take` gives every token not written yet, in one entry. A re-run (attempt > 1) starts
    with a pending restart entry, so the entries after the last restart always concatenate
    to the final result's text.
    """

    text: str = ""
    num_tokens: int = 0
    pending: list[dict[str, str]] = field(default_factory=list)
    ttl_set: bool = False
    enabled: bool = True

    @classmethod
    def for_attempt(cls, attempt: int, enabled: bool = True) -> StreamState:
        """The state of a new run: a re-run starts with the restart entry."""
        pending = [restart_entry()] if attempt > 1 and enabled else []
        return cls(pending=pending, enabled=enabled)

    def num_new(self, completion: Any) -> int:
        """How many tokens of `completion` (choice 0) are not written yet."""
        return len(completion.token_ids) - self.num_tokens

    def token_entry(self, completion: Any) -> dict[str, str] | None:
        """The entry of choice 0's tokens not written yet, or None when nothing is new."""
        new_ids = list(completion.token_ids[self.num_tokens :])
        if not new_ids:
            return None
        delta = completion.text[len(self.text) :]
        self.text = completion.text
        self.num_tokens += len(new_ids)
        return token_entry(delta, new_ids)

    def take(self, completion: Any | None) -> list[dict[str, str]]:
        """The entries to write now: a pending restart, then every token not written yet."""
        if not self.enabled:
            return []
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


def stream_entries(item: InFlight) -> list:
    """The entries of `item`'s tokens not written yet: (claim, fields, set_ttl) each."""
    entries = []
    for fields in item.stream.take(item.last_output.outputs[0]):
        entries.append((item.claim, fields, not item.stream.ttl_set))
        item.stream.ttl_set = True
    return entries


def window_entries(job_ids, in_flight: dict[str, InFlight]) -> list:
    """The entries of every job whose tokens waited for the window (one per job)."""
    entries = []
    for job_id in job_ids:
        item = in_flight.get(job_id)
        if item is not None and item.last_output is not None:
            entries += stream_entries(item)
    return entries

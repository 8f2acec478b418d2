"""Per-job token streams: one XADD per engine step per job, then a done or error entry."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from producer.keys import STREAM_MAXLEN


@dataclass(slots=True)
class StreamState:
    """What a job's stream already holds: its text and the number of its tokens."""

    text: str = ""
    num_tokens: int = 0

    @classmethod
    def from_entries(cls, entries: list[tuple[Any, dict]]) -> StreamState:
        """Rebuild the state from XRANGE entries; a re-run job then streams only what is new."""
        state = cls()
        for _, fields in entries:
            fields = {_text(k): _text(v) for k, v in fields.items()}
            if fields.get("event") == "token":
                state.text += fields.get("delta", "")
                state.num_tokens += len(json.loads(fields.get("token_ids", "[]")))
        return state

    def token_entry(self, completion: Any) -> dict[str, str] | None:
        """The entry for this step's new tokens of choice 0, or None when nothing is new."""
        new_ids = list(completion.token_ids[self.num_tokens :])
        if not new_ids:
            return None
        # A re-run (at-least-once) regenerates what the stream already holds; skip that prefix.
        delta = completion.text[len(self.text) :] if completion.text.startswith(self.text) else ""
        self.text += delta
        self.num_tokens += len(new_ids)
        return {"event": "token", "delta": delta, "token_ids": json.dumps(new_ids)}


def xadd(pipeline: Any, key: str, fields: dict[str, str], ttl: int) -> None:
    """Append one entry to a job stream (capped, with a TTL) on a pipeline."""
    pipeline.xadd(key, fields, maxlen=STREAM_MAXLEN, approximate=True)
    pipeline.expire(key, ttl)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

"""The entries of a job's token stream (`pagedq:stream:{job_id}`), for the worker that writes
them and every reader (`Client.stream`, the gateway's SSE, other languages via docs/PROTOCOL.md).

Field/value pairs, all strings:

- `event=token delta=<text> token_ids=<JSON list>`: the tokens of choice 0 sampled since the
  job's previous entry, with their text. A worker writes one such entry per job per window
  (`--stream-interval`), so an entry carries every token of its window; the first token of a
  run is written at once. The deltas of a run concatenate to its final text, and its
  `token_ids` lists to its final token ids.
- `event=restart`: a re-run of the job starts (its worker died); drop what was read before it.
- `event=done finish_reason=<reason>`: the job finished; its result key is written.
- `event=error error=<message>`: the job failed (`error=canceled`: it was canceled).
"""

from __future__ import annotations

import json

EVENT = "event"
TOKEN = "token"
RESTART = "restart"
DONE = "done"
ERROR = "error"
FINAL_EVENTS = (DONE, ERROR)
# The longest token_ids value a reader parses (ids of a window are far fewer).
MAX_TOKEN_IDS_CHARS = 1 << 20


def token_entry(delta: str, token_ids: list[int]) -> dict[str, str]:
    """The entry of the tokens `token_ids` (text `delta`) sampled in one window."""
    return {EVENT: TOKEN, "delta": delta, "token_ids": json.dumps(token_ids)}


def restart_entry() -> dict[str, str]:
    """The first entry of a re-run."""
    return {EVENT: RESTART}


def done_entry(finish_reason: str | None) -> dict[str, str]:
    """The final entry of a finished job."""
    return {EVENT: DONE, "finish_reason": str(finish_reason)}


def error_entry(message: str) -> dict[str, str]:
    """The final entry of a failed or canceled job."""
    return {EVENT: ERROR, "error": message}


def is_final(entry: dict[str, str]) -> bool:
    """True for the done/error entry that ends a job's stream."""
    return entry.get(EVENT) in FINAL_EVENTS


def entry_delta(entry: dict[str, str]) -> str:
    """The text a token entry adds ("" for any other entry)."""
    return entry.get("delta", "") if entry.get(EVENT) == TOKEN else ""


def entry_token_ids(entry: dict[str, str]) -> list[int]:
    """The token ids a token entry adds ([] for any other entry, or a malformed one)."""
    raw = entry.get("token_ids", "") if entry.get(EVENT) == TOKEN else ""
    if not raw or len(raw) > MAX_TOKEN_IDS_CHARS:
        return []
    try:
        ids = json.loads(raw)
    except ValueError:
        return []
    return [i for i in ids if isinstance(i, int)] if isinstance(ids, list) else []

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

A job enqueued with an inline wake id (`pq_wake` ending in `INLINE_WAKE`, as the gateway's
StreamHub enqueues) gets no entries in its own stream: the worker writes them into the hub's
wake stream, in the entry of the call that wrote them, whose field `entries` is a JSON object
of job id -> the list of that job's entries in the call (`encode_inline`). One XADD per hub and
call then carries the tokens of all its jobs, built by the worker, instead of one per job.
When such a job ends, its result key is written in the same script call as its final entry,
so a reader of that entry finds the result there (the gateway's StreamHub reads those of one
read with one MGET, and puts each in its job's final entry as `result`, when at most
`MAX_INLINE_RESULT_CHARS` long). A worker of an older release gave the result in the wake
entry itself, as the field `result:<job id>` (`inline_entries` still puts it in the job's final
entry).

A wake id ending in `DELTAS_WAKE` is inline too, for a reader that needs only the text (the
gateway's StreamHub: OpenAI's streams carry no token ids): a token entry goes into `entries` as
the JSON string of its delta alone, and the wake entry has no `jobs` field (its jobs are the keys
of `entries`). That halves the bytes a window of tokens costs Redis to take in, keep and hand
out. A worker of an older release treats such a wake id as a plain one (job streams, listed
jobs), which every hub reads too.
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
# What ends an inline wake id, and the field of an inline wake entry that carries the entries.
INLINE_WAKE = ":inline"
DELTAS_WAKE = ":deltas"
ENTRIES_FIELD = "entries"
# The longest inline value a reader parses (a window of a hub's jobs is far less).
MAX_INLINE_CHARS = 1 << 22
# The field of the final entry a hub's reader gets that carries the job's result (`result:<job
# id>` in a wake entry of an older worker), and the longest result carried.
RESULT_FIELD = "result"
MAX_INLINE_RESULT_CHARS = 1 << 15


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


def is_inline(wake: str) -> bool:
    """True for a wake id whose jobs' entries go into the wake stream itself."""
    return wake.endswith((INLINE_WAKE, DELTAS_WAKE))


def takes_deltas(wake: str) -> bool:
    """True for an inline wake id whose token entries are their delta text alone."""
    return wake.endswith(DELTAS_WAKE)


def inline_entry(wake: str, entry: dict[str, str]) -> dict[str, str] | str:
    """What `entries` carries of `entry` for the reader of `wake`: a token entry's delta alone
    for a reader of deltas, else the entry."""
    if entry.get(EVENT) == TOKEN and takes_deltas(wake):
        return entry.get("delta", "")
    return entry


def encode_inline(by_job: dict[str, list[dict[str, str] | str]]) -> str:
    """The entries of one call, job id -> that job's entries in order, as an inline wake entry
    carries them."""
    return json.dumps(by_job, separators=(",", ":"))


def decode_inline(raw: str) -> dict[str, list[dict[str, str]]]:
    """The entries an inline wake entry carries, by job ({} for a malformed or oversized one)."""
    if len(raw) > MAX_INLINE_CHARS:
        return {}
    try:
        by_job = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(by_job, dict):
        return {}
    return {
        str(job_id): [e for e in map(_fields, entries) if e is not None]
        for job_id, entries in by_job.items()
        if isinstance(entries, list)
    }


def _fields(entry: object) -> dict[str, str] | None:
    if isinstance(entry, str):  # a token entry of a reader of deltas
        return {EVENT: TOKEN, "delta": entry}
    if isinstance(entry, dict):
        return {str(k): str(v) for k, v in entry.items()}
    return None


def inline_job_ids(fields: dict[bytes, bytes], by_job: dict[str, list]) -> list[str]:
    """The jobs a wake entry (its raw fields; `by_job` its inline entries) tells of: those
    listed in `jobs`, or, without that field (a reader of deltas), those it carries."""
    listed = fields.get(b"jobs")
    return listed.decode().split() if listed is not None else list(by_job)


def inline_entries(fields: dict[bytes, bytes]) -> dict[str, list[dict[str, str]]]:
    """The entries an inline wake entry (its raw fields) carries, by job; a job's result, when
    the entry carries it, is in its final entry as `result`."""
    by_job = decode_inline(fields.get(ENTRIES_FIELD.encode(), b"{}").decode())
    prefix = f"{RESULT_FIELD}:".encode()
    for name, value in fields.items():
        if not name.startswith(prefix) or len(value) > MAX_INLINE_RESULT_CHARS:
            continue
        entries = by_job.get(name[len(prefix) :].decode())
        if entries and is_final(entries[-1]):
            entries[-1][RESULT_FIELD] = value.decode()
    return by_job

"""Follow the token streams of many jobs at once, without polling, until each one ends."""

from __future__ import annotations

import time
from collections.abc import Iterable

from redis import Redis

from producer.connection import xread
from producer.contract.keys import result_key, rq_job_key, stream_key
from producer.results import decode_entry, is_final, rq_end

Event = tuple[str, dict[str, str]]
# The synthetic final entry of a job whose result key exists: the reader takes the result.
RESULT_READY = {"event": "done", "status": "result"}


class StreamFollower:
    """Reads the streams of the jobs it follows with one blocking XREAD; yields their entries.

    A job stops being followed after its final done/error entry. Every `check_interval`
    seconds the followed jobs are also checked in Redis, because some ends write no stream
    entry (RQ failing an abandoned job, a queued job canceled) and streams expire before
    results do; such a job gets a synthetic final entry carrying a "status" field. With
    `quiet_checks` (one job followed, as `Client.stream` does) the check runs only once its
    stream was quiet for `check_interval`: while entries come, its final entry will too.
    """

    def __init__(
        self,
        connection: Redis,
        job_ids: Iterable[str] = (),
        check_interval: float = 2.0,
        count: int = 512,
        quiet_checks: bool = False,
    ) -> None:
        self.connection = connection
        self.check_interval = check_interval
        self.quiet_checks = quiet_checks
        self.count = count
        self._last_ids: dict[str, str] = {}
        self._next_check = 0.0
        for job_id in job_ids:
            self.add(job_id)

    def add(self, job_id: str) -> None:
        """Follow a job's stream from its first entry."""
        self._last_ids.setdefault(job_id, "0")
        self._next_check = 0.0

    def __len__(self) -> int:
        return len(self._last_ids)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._last_ids

    def read(self, block_s: float) -> list[Event]:
        """New (job_id, entry) events; waits at most `block_s` seconds for the first one."""
        if not self._last_ids:
            return []
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self.check_interval
            events = self._check_ended()
            if events:
                return events
        wait_s = min(block_s, max(0.0, self._next_check - time.monotonic()))
        block_ms = int(wait_s * 1000)
        streams = {stream_key(job_id): last for job_id, last in self._last_ids.items()}
        # block=0 would mean "forever" to Redis, so a zero wait is a plain non-blocking read.
        reply = xread(self.connection, streams, self.count, block_ms or None)
        events: list[Event] = []
        for key, entries in reply or []:
            job_id = key.decode().removeprefix(stream_key(""))
            events += self._take(job_id, entries)
        if events and self.quiet_checks:
            self._next_check = time.monotonic() + self.check_interval
        return events

    def _take(self, job_id: str, entries: list) -> list[Event]:
        events: list[Event] = []
        for entry_id, fields in entries:
            if job_id not in self._last_ids:
                break
            entry = decode_entry(fields)
            self._last_ids[job_id] = entry_id.decode()
            events.append((job_id, entry))
            if is_final(entry):
                del self._last_ids[job_id]
        return events

    def _check_ended(self) -> list[Event]:
        events: list[Event] = []
        for job_id, ended in check_ended(self.connection, list(self._last_ids)).items():
            # Drain what the stream still holds first, so no delta is lost to the synthetic end.
            last = self._last_ids[job_id]
            start = "-" if last == "0" else f"({last}"
            events += self._take(job_id, self.connection.xrange(stream_key(job_id), start, "+"))
            if job_id in self._last_ids:
                del self._last_ids[job_id]
                events.append((job_id, ended))
        return events


def check_ended(connection: Redis, job_ids: list[str]) -> dict[str, dict[str, str]]:
    """A synthetic final entry for each of `job_ids` that has ended (by its result key, else
    RQ's status); one pipelined round trip."""
    if not job_ids:
        return {}
    pipe = connection.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.exists(result_key(job_id))
        pipe.hget(rq_job_key(job_id), "status")
    replies = pipe.execute()
    out: dict[str, dict[str, str]] = {}
    for i, job_id in enumerate(job_ids):
        has_result, status = replies[2 * i], replies[2 * i + 1]
        status = status.decode() if status is not None else None
        ended = dict(RESULT_READY) if has_result else rq_end(connection, job_id, status)
        if ended is not None:
            out[job_id] = ended
    return out

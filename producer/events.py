"""Follow many jobs that do not stream through one events stream of the producer's own.

A bulk producer (``pagedq submit``, ``BulkRun``) enqueues its jobs with a `notify` id; the
script that ends such jobs adds their ids and statuses to ``events_key(notify)`` (one entry
per script call, however many of the producer's jobs it ended), but only while that stream
exists (NOMKSTREAM): the producer creates it and keeps its TTL fresh, so a producer that went
away leaves nothing behind for long. Reading it is one blocking
XREAD for every job in flight, instead of one stream per job. Ends that write no event (a queued
job canceled, an RQ reaper's failure, an event trimmed or expired) are found by a slow check of
the result keys, every `check_interval` seconds. With a sharded queue each shard's jobs tell
a stream of the shard's own (`shard_name(tag, notify)`: in the shard's hash slot), and all of
them are read.
"""

from __future__ import annotations

import time
import uuid

from redis import Redis

from producer.connection import xread
from producer.contract.keys import events_key
from producer.contract.shards import shard_name
from producer.follow import RESULT_READY, Event, check_ended

# How long an events stream outlives its producer's last read.
EVENTS_TTL_S = 3600
# The fallback check of results: rare, since nearly every end writes an event.
CHECK_INTERVAL_S = 60.0


def new_notify_id() -> str:
    """A fresh notify id (one per producer run)."""
    return uuid.uuid4().hex


def ended_job_ids(fields: dict[bytes, bytes]) -> list[str]:
    """The job ids an events entry reports ended: `jobs` (space-separated, one entry per
    ending call) or `job_id` (one per entry, as workers before 2026-11-27 wrote)."""
    if b"jobs" in fields:
        return fields[b"jobs"].decode(errors="replace").split()
    job_id = fields.get(b"job_id", b"").decode(errors="replace")
    return [job_id] if job_id else []


class EventFollower:
    """Waits for the ends of the jobs it follows, by their events in one stream.

    Same interface as StreamFollower, for jobs that write no token entries: `read` yields
    (job_id, final entry) once per followed job, the entry saying its result is ready (or, from
    the check, how it ended without one).
    """

    def __init__(
        self,
        connection: Redis,
        notify: str | None = None,
        check_interval: float = CHECK_INTERVAL_S,
        count: int = 1024,
        tags: list[str] | tuple[str, ...] = ("",),
    ) -> None:
        self.connection = connection
        self.notify = notify or new_notify_id()
        # One stream per queue shard (hash tag; '' unsharded), each read from its last entry.
        self._last_ids = {events_key(shard_name(tag, self.notify)): "0" for tag in tags}
        self.check_interval = check_interval
        self.count = count
        self._jobs: set[str] = set()
        self._unchecked: list[str] = []
        self._next_check = 0.0
        self._opened = False

    def open(self) -> None:
        """Create the stream (an `open` entry) and give it its TTL; done by `read` too."""
        pipe = self.connection.pipeline(transaction=False)
        for key in self._last_ids:
            pipe.xadd(key, {"event": "open"})
            pipe.expire(key, EVENTS_TTL_S)
        pipe.execute()
        self._opened = True
        self._next_check = time.monotonic() + self.check_interval

    def add(self, job_id: str, ended: bool = False) -> None:
        """Follow a job; `ended`: its result may already be in Redis (checked at the next
        read, as are jobs added before the stream was opened)."""
        self._jobs.add(job_id)
        if ended or not self._opened:
            self._unchecked.append(job_id)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def read(self, block_s: float) -> list[Event]:
        """Ended jobs among those followed; waits at most `block_s` seconds for the first."""
        if not self._opened:
            self.open()
        events = self._ended(self._unchecked)
        self._unchecked = []
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self.check_interval
            for key in self._last_ids:
                self.connection.expire(key, EVENTS_TTL_S)
            events += self._ended(list(self._jobs))
        if events or not self._jobs:
            return events
        wait_s = min(block_s, max(0.0, self._next_check - time.monotonic()))
        block_ms = int(wait_s * 1000)
        reply = xread(self.connection, dict(self._last_ids), self.count, block_ms or None)
        for key, entries in reply or []:
            for entry_id, fields in entries:
                self._last_ids[key.decode()] = entry_id.decode()
                for job_id in ended_job_ids(fields):
                    if job_id in self._jobs:
                        self._jobs.discard(job_id)
                        events.append((job_id, dict(RESULT_READY)))
        if not reply and not all(self.connection.exists(k) for k in self._last_ids):
            self.open()  # expired (the producer paused for an hour) or Redis restarted empty
        return events

    def _ended(self, job_ids: list[str]) -> list[Event]:
        found = check_ended(self.connection, [j for j in job_ids if j in self._jobs])
        for job_id in found:
            self._jobs.discard(job_id)
        return list(found.items())

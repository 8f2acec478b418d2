"""Every token stream a gateway follows, read on one connection, woken by the workers.

A request follows its job's stream through a `Follow` (an asyncio queue of entries). The
gateway enqueues its jobs with the hub's wake id, which is inline (producer/contract/stream.py):
a worker's call writes the entries of all the hub's jobs into one entry of the hub's wake
stream (`wake_key`, one entry per hub and call; its `entries` field, a JSON object by job), not
into each job's stream, so a window of a worker's 64 streaming jobs is one XADD, and the hub's
one XREAD of its wake stream reads them all. A worker of an older release writes each job's
stream and only lists the job in the wake entry; the hub then reads the streams listed there:
Redis's work follows the entries written, not the number of streams followed (a blocking
XREAD naming every followed stream cost about 0.5 us per stream per read, entries or not).
Entries of a job not followed yet (its request is between its enqueue and its follow) wait in
the hub for UNCLAIMED_S. Reads are paced
(READ_INTERVAL_S), so one read takes the windows of many workers. A new follow whose stream
may hold entries (a hub that is not inline, or a job an older worker listed) is read at once
and wakes a blocked read with CLIENT UNBLOCK (as does a follow on a new wake stream); every CHECK_S
the followed jobs that got no entry for CHECK_S are looked up and their streams read, because
some ends write no stream entry (a queued job canceled through RQ), streams expire before
results do, and a worker of an older release tells no wake stream. A job whose entries keep
coming is not looked up: the check costs Redis per quiet job, not per followed job. A job the
check finds ended gets the wake entries written before the look-up first, so no delta is lost to
the end. The final entries a read delivers carry their jobs' results, read from the result keys
with one MGET per read (a worker stages a result beside its end, outside Lua).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field

from redis.exceptions import RedisError
from rq.job import Job

from producer.connection import async_redis_client, async_xread, is_cluster, mget
from producer.contract.keys import result_key, stream_key, wake_key
from producer.contract.shards import hash_tag, shard_name
from producer.contract.stream import (
    DELTAS_WAKE,
    MAX_INLINE_RESULT_CHARS,
    RESULT_FIELD,
    inline_entries,
    inline_job_ids,
    is_inline,
)
from producer.results import decode_entry, is_final

log = logging.getLogger("pagedq.gateway.streams")

BLOCK_MS = 1000
# Shortest time between two reads: every worker's stream window and every new request would
# otherwise wake the hub on its own; paced, one read takes the windows of many workers and the
# follows of many requests.
READ_INTERVAL_S = 0.05
CHECK_S = 2.0
# How long the inline entries of a job not followed (yet) wait for their follow.
UNCLAIMED_S = 10.0
COUNT = 512
POOL_SIZE = 64
POOL_WAIT_S = 30.0


@dataclass(eq=False)
class Follow:
    """The entries of one job's stream, from its first, ending with a done/error entry."""

    job_id: str
    entries: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_id: str = "0"


class StreamHub:
    """Reads the streams of all followed jobs and hands each entry to its follower."""

    def __init__(self, redis_url: str, wake_id: str | None = None) -> None:
        self.wake_id = wake_id or uuid.uuid4().hex + DELTAS_WAKE
        """What this hub's jobs are enqueued with (`Client.enqueue(wake=...)`); by default
        inline, of deltas: the workers write the jobs' entries into its wake stream, a token
        entry as its text alone."""
        # Many requests at once wait for a pooled connection rather than fail.
        self.redis = async_redis_client(
            redis_url, blocking=True, max_connections=POOL_SIZE, timeout=POOL_WAIT_S
        )
        self._reader = async_redis_client(redis_url, single_connection_client=True)
        self._follows: dict[str, list[Follow]] = {}
        self._wakes: dict[str, str] = {}  # wake stream (one per queue shard) -> last id read
        self._due: set[str] = set()  # followed jobs whose streams the next read reads
        self._heard: dict[str, float] = {}  # followed job -> when its last entries came
        # job not followed (yet) -> when its first inline entries came, and them (None: its
        # stream has entries)
        self._unclaimed: dict[str, tuple[float, list[dict[str, str] | None]]] = {}
        self._reader_id: int | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._next_check = 0.0
        self._wake_scheduled = False
        self._blocked = False

    def __len__(self) -> int:
        return sum(len(f) for f in self._follows.values())

    async def start(self) -> None:
        """Start the reading task."""
        self._task = asyncio.create_task(self._run(), name="stream-hub")

    async def close(self) -> None:
        """Stop reading and close the connections."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._reader.aclose()
        await self.redis.aclose()

    def follow(self, job_id: str) -> Follow:
        """Follow a job's stream from its first entry."""
        follow = Follow(job_id)
        self._follows.setdefault(job_id, []).append(follow)
        # Quiet from its follow on, not from ever: the check looks up a job that got no entry
        # for CHECK_S (a job is asked about once it waited that long, not at the next check).
        self._heard.setdefault(job_id, time.monotonic())
        key = wake_key(shard_name(hash_tag(job_id), self.wake_id))
        new_key = key not in self._wakes
        self._wakes.setdefault(key, "0")
        _, waiting = self._unclaimed.pop(job_id, (0.0, []))
        self._deliver_inline(job_id, [e for e in waiting if e is not None])
        # An inline hub's entries come in its wake stream, read anyway: the job's own stream
        # is read at once only when it may hold some (an older release's worker listed it).
        due = not is_inline(self.wake_id) or None in waiting
        if due:
            self._due.add(job_id)
        self._changed.set()
        if (due or new_key) and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().create_task(self._wake())
        return follow

    async def _wake(self) -> None:
        """Unblock the reader once for the new follows of one read interval, so it reads them
        within that interval (a reader between two reads takes them in the next)."""
        await asyncio.sleep(READ_INTERVAL_S)
        self._wake_scheduled = False
        if self._reader_id is not None and self._blocked:
            with contextlib.suppress(RedisError):
                await self.redis.client_unblock(self._reader_id)

    def unfollow(self, follow: Follow) -> None:
        """Stop following (the request ended or went away)."""
        follows = self._follows.get(follow.job_id, [])
        if follow in follows:
            follows.remove(follow)
        if not follows:
            self._follows.pop(follow.job_id, None)
            self._heard.pop(follow.job_id, None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if not self._follows:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                if self._reader_id is None and not is_cluster(self._reader):
                    # A cluster's reader polls instead of blocking (async_xread).
                    self._reader_id = await self._reader.client_id()
                if loop.time() >= self._next_check:
                    self._next_check = loop.time() + CHECK_S
                    await self._check_ended()
                started = loop.time()
                await self._read()
                await asyncio.sleep(max(0.0, started + READ_INTERVAL_S - loop.time()))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("stream hub: Redis failed (%s: %s); retrying", type(exc).__name__, exc)
                self._reader_id = None
                await asyncio.sleep(1.0)

    async def _read(self) -> bool:
        """Read the wake streams (blocking unless some followed stream is due already: a new
        follow, the check), then one XREAD of the due streams; True when entries came."""
        self._changed.clear()
        block = None if self._due & self._follows.keys() else BLOCK_MS
        await self._read_wakes(block)
        due, self._due = self._due & self._follows.keys(), set()
        if not due:  # woken by a new follow, or for jobs no longer followed
            return False
        streams = {stream_key(j): self._last_id(j) for j in due}
        reply = await async_xread(self._reader, streams, COUNT, None)
        for key, entries in reply:
            job_id = key.decode().split(":", 2)[2]
            self._deliver(job_id, entries)
            if len(entries) == COUNT:  # more than one read's worth: read on next time
                self._due.add(job_id)
        return bool(reply)

    async def _read_wakes(self, block: int | None) -> None:
        """Read the wake streams: deliver the inline entries, and mark due the streams of the
        jobs listed without them (written by a worker of an older release)."""
        self._blocked = block is not None
        try:
            woken = await async_xread(self._reader, dict(self._wakes), COUNT, block)
        finally:
            self._blocked = False
        now = time.monotonic()
        followed: list[tuple[str, list[dict[str, str]]]] = []
        for key, entries in woken:
            self._wakes[key.decode()] = entries[-1][0].decode()
            for _, fields in entries:
                by_job = inline_entries(fields)
                for job_id in inline_job_ids(fields, by_job):
                    inline = by_job.get(job_id)
                    if job_id in self._follows:
                        if inline is None:
                            self._due.add(job_id)
                        else:
                            followed.append((job_id, inline))
                    else:
                        self._unclaimed.setdefault(job_id, (now, []))[1].extend(inline or [None])
        await self._add_results(followed)
        for job_id, inline in followed:
            self._deliver_inline(job_id, inline)
        for job_id in [j for j, (t, _) in self._unclaimed.items() if t < now - UNCLAIMED_S]:
            del self._unclaimed[job_id]

    async def _add_results(self, followed: list[tuple[str, list[dict[str, str]]]]) -> None:
        """Put each ended job's result in its final entry (as `result`), read from the result
        keys with one MGET: the worker staged it beside the end, so it exists by the time the
        final entry can be read, and it never passed through a Lua script. When the MGET fails
        the entries go without (the wake stream was read already: they must not be lost), and
        their readers GET the result key."""
        finals = {
            job_id: entries[-1]
            for job_id, entries in followed
            if entries and is_final(entries[-1]) and RESULT_FIELD not in entries[-1]
        }
        if not finals:
            return
        try:
            values = await mget(self.redis, [result_key(job_id) for job_id in finals])
        except (RedisError, OSError) as exc:
            log.warning("stream hub: reading %d results failed (%s)", len(finals), exc)
            return
        for entry, value in zip(finals.values(), values, strict=True):
            if value is not None and len(value) <= MAX_INLINE_RESULT_CHARS:
                entry[RESULT_FIELD] = value.decode()

    def _deliver_inline(self, job_id: str, entries: list[dict[str, str]]) -> None:
        """Hand `entries` (read from a wake stream, in order, once) to the job's followers."""
        if entries and job_id in self._follows:
            self._heard[job_id] = time.monotonic()
        for entry in entries:
            for follow in list(self._follows.get(job_id, [])):
                follow.entries.put_nowait(entry)
                if is_final(entry):
                    self.unfollow(follow)

    def _last_id(self, job_id: str) -> str:
        return min((f.last_id for f in self._follows[job_id]), key=_entry_order)

    def _deliver(self, job_id: str, entries: list) -> None:
        if entries and job_id in self._follows:
            self._heard[job_id] = time.monotonic()
        for entry_id, fields in entries:
            entry_id = entry_id.decode()
            entry = decode_entry(fields)
            for follow in list(self._follows.get(job_id, [])):
                if _entry_order(entry_id) <= _entry_order(follow.last_id):
                    continue
                follow.last_id = entry_id
                follow.entries.put_nowait(entry)
                if is_final(entry):
                    self.unfollow(follow)

    async def _check_ended(self) -> None:
        quiet_since = time.monotonic() - CHECK_S
        job_ids = [j for j in self._follows if self._heard.get(j, quiet_since) <= quiet_since]
        if not job_ids:
            return
        self._due.update(job_ids)  # the next read reads every quiet stream once
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(result_key(job_id))
            pipe.hget(Job.key_for(job_id), "status")
        replies = await pipe.execute()
        # An end seen by the look-up wrote its inline entries before it: take them first.
        await self._read_wakes(None)
        for i, job_id in enumerate(job_ids):
            has_result, status = replies[2 * i], replies[2 * i + 1]
            ended = _synthetic_end(bool(has_result), status.decode() if status else None)
            if ended is None or job_id not in self._follows:
                continue
            # Deliver what the stream still holds first, so no delta is lost to the end.
            self._deliver(job_id, await self.redis.xrange(stream_key(job_id), "-", "+"))
            for follow in list(self._follows.get(job_id, [])):
                follow.entries.put_nowait(ended)
                self.unfollow(follow)


def _synthetic_end(has_result: bool, status: str | None) -> dict[str, str] | None:
    """The final entry of a job that ended without writing one (None: not ended)."""
    if has_result:
        return {"event": "done", "status": "result"}
    if status is None:
        return {"event": "error", "error": "job not found", "status": "not_found"}
    if status in ("canceled", "stopped"):
        return {"event": "error", "error": "canceled", "status": "canceled"}
    if status == "failed":
        return {"event": "error", "error": "failed", "status": "failed"}
    return None


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)

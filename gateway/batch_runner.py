"""The batch runner: a thread in every gateway that moves active batches along, under leases.

Any gateway may take any batch: a lease (`pagedq:batch-lease:{id}`, renewed while it works)
makes one gateway at a time validate, enqueue, cancel or finalize a batch, and every step is
safe to redo, so a gateway killed at any point is replaced by the next one whose lease comes up.
Enqueueing goes one stored chunk at a time, each chunk committed with a compare-and-set on
`next_chunk`; a redone chunk skips the jobs that already exist. Lines are counted by the
scripts that end their jobs (producer.contract.keys.batch_counts_key), so nothing here polls
jobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from itertools import islice

from redis import Redis
from redis.exceptions import RedisError
from rq.job import Job

from gateway.batch_lines import BatchLines
from gateway.batch_output import output_lines
from gateway.batch_store import ENDED, BatchStore
from gateway.config import GatewayConfig
from gateway.file_store import FileStore, chunk_lines
from gateway.keys import (
    ACTIVE_BATCHES,
    batch_counts_key,
    batch_key,
    batch_lease_key,
    batch_ref,
    file_key,
    files_index_key,
)
from gateway.metrics import BATCHES_ENDED
from producer.client import Client
from producer.contract.keys import result_key
from producer.openai_batch import FileFormatError

log = logging.getLogger("pagedq.gateway.batches")

MAX_BATCH_ERRORS = 100
ENQUEUE_CHUNK = 500
# Seconds of work on one batch before the runner looks at the others.
TICK_BUDGET_S = 3.0
LIVE_STATUSES = ("queued", "started", "deferred", "scheduled", "created")

# KEYS[1]: the lease. ARGV: this gateway's token, lease ms. Takes or renews it; 1 when held.
HOLD = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if owner then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS[1]: the lease. ARGV[1]: the token. Drops the lease if this gateway holds it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS[1]: the batch hash, KEYS[2]: its counts. ARGV: the chunk just enqueued, its number of
# requests, of those refused for their body. Moves `next_chunk` on (once: a redone chunk finds
# it moved) and counts the refused lines as failed.
COMMIT_CHUNK = """
if tonumber(redis.call('HGET', KEYS[1], 'next_chunk')) ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'next_chunk', tonumber(ARGV[1]) + 1)
redis.call('HINCRBY', KEYS[1], 'lines_done', ARGV[2])
if tonumber(ARGV[3]) > 0 then
    redis.call('HINCRBY', KEYS[2], 'failed', ARGV[3])
    redis.call('HINCRBY', KEYS[2], 'invalid', ARGV[3])
end
return 1
"""


def ended_lines(counts: dict[str, str]) -> int:
    """Lines of a batch that have ended, by its counts."""
    return sum(int(counts.get(k, 0)) for k in ("finished", "failed", "canceled"))


class BatchRunner:
    """Moves every active batch along; one per gateway process, on its own thread."""

    def __init__(
        self,
        redis: Redis,
        client: Client,
        files: FileStore,
        batches: BatchStore,
        config: GatewayConfig,
    ) -> None:
        self.redis, self.client, self.files, self.batches = redis, client, files, batches
        self.config = config
        self.token = uuid.uuid4().hex
        self._hold = redis.register_script(HOLD)
        self._release = redis.register_script(RELEASE)
        self._commit = redis.register_script(COMMIT_CHUNK)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: set[str] = set()

    def start(self) -> None:
        """Start the runner thread."""
        self._thread = threading.Thread(target=self._run, name="batch-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current step and release this gateway's leases."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        # A clean stop hands its batches over at once instead of after the lease.
        for batch_id in list(self._held):
            with contextlib.suppress(RedisError):
                self._release(keys=[batch_lease_key(batch_id)], args=[self.token])

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = False
            try:
                for raw in self.redis.smembers(ACTIVE_BATCHES):
                    if self._stop.is_set():
                        return
                    try:
                        busy |= self._tick(raw.decode())
                    except LeaseLost:
                        log.warning("batch runner: lost the lease of %s", raw.decode())
            except RedisError as exc:
                log.warning("batch runner: Redis unreachable (%s); retrying", type(exc).__name__)
                self._stop.wait(2.0)
            except Exception:
                log.exception("batch runner: unexpected error")
                self._stop.wait(2.0)
            if not busy:
                self._stop.wait(self.config.batch_poll_s)

    # --- one batch ------------------------------------------------------------------------------

    def _tick(self, batch_id: str) -> bool:
        """One bounded step of work on a batch; True when more work is waiting."""
        fields = self.batches.fields(batch_id)
        if not fields or fields["status"] in ENDED:
            self.redis.srem(ACTIVE_BATCHES, batch_id)
            self._release(keys=[batch_lease_key(batch_id)], args=[self.token])
            return False
        if fields.get("queue") != self.client.queue.name:
            return False  # a batch of another queue: its own gateways run it
        if not self.hold(batch_id):
            return False
        status = fields["status"]
        # Validation is bounded (one pass over the file): the window runs out on lines only.
        if status == "in_progress" and not fields.get("stop"):
            if time.time() >= int(fields["expires_at"]):
                self.batches.transition(batch_id, ("in_progress",), stop="expired")
                fields = self.batches.fields(batch_id)
        if fields.get("stop"):
            return self._stopping(batch_id, fields)
        if status == "validating":
            self._validate(batch_id, fields)
            return True
        if status == "in_progress":
            return self._progress(batch_id, fields)
        if status == "finalizing":
            self._finalize(batch_id, fields, "completed")
        return False

    def hold(self, batch_id: str) -> bool:
        """Take or renew this gateway's lease on a batch."""
        ms = int(self.config.batch_lease_s * 1000)
        held = bool(self._hold(keys=[batch_lease_key(batch_id)], args=[self.token, ms]))
        (self._held.add if held else self._held.discard)(batch_id)
        return held

    def _renewer(self, batch_id: str) -> Callable[[], None]:
        def renew() -> None:
            if not self.hold(batch_id):
                raise LeaseLost(batch_id)

        return renew

    def _lines(self, fields: dict[str, str]) -> BatchLines:
        return BatchLines.of(self.files, fields)

    def _validate(self, batch_id: str, fields: dict[str, str]) -> None:
        """Check the whole file as OpenAI does while `validating`; failed with line numbers."""
        lines, endpoint = self._lines(fields), fields["endpoint"]
        renew = self._renewer(batch_id)
        errors: list[dict] = []
        first_line: dict[str, int] = {}
        requests = 0

        def refuse(code: str, line: int | None, message: str, param: str | None = None) -> None:
            if len(errors) < MAX_BATCH_ERRORS:
                errors.append({"code": code, "line": line, "message": message, "param": param})

        starts = lines.chunk_starts()
        for index, chunk in enumerate(self.files.chunks(lines.file_id)):
            for no, raw in chunk_lines(chunk, starts[index]):
                requests += 1
                try:
                    parsed = lines.parse(raw, no)
                except FileFormatError as exc:
                    refuse("invalid_request", no, str(exc))
                    continue
                if parsed.url != endpoint:
                    refuse(
                        "mismatched_endpoint",
                        no,
                        f"line {no}: url {parsed.url} is not the batch's endpoint {endpoint}",
                        "url",
                    )
                if parsed.custom_id in first_line:
                    refuse(
                        "duplicate_custom_id",
                        no,
                        f"line {no}: custom_id {parsed.custom_id!r} is also on line "
                        f"{first_line[parsed.custom_id]}; each must be unique in a batch",
                        "custom_id",
                    )
                first_line.setdefault(parsed.custom_id, no)
            renew()
        if requests > self.config.max_file_lines:
            refuse(
                "too_many_requests",
                None,
                f"the file has {requests} requests; a batch holds at most "
                f"{self.config.max_file_lines}",
            )
        now = int(time.time())
        if errors:
            if self.batches.transition(
                batch_id, ("validating",), status="failed", failed_at=now, errors=json.dumps(errors)
            ):
                BATCHES_ENDED.labels(status="failed").inc()
            self.redis.srem(ACTIVE_BATCHES, batch_id)
        else:
            self.batches.transition(
                batch_id, ("validating",), status="in_progress", in_progress_at=now, total=requests
            )

    def _progress(self, batch_id: str, fields: dict[str, str]) -> bool:
        """Enqueue the next chunks (for up to TICK_BUDGET_S), or finalize once all lines ended."""
        lines = self._lines(fields)
        num_chunks = len(lines.chunk_starts())
        next_chunk = int(fields["next_chunk"])
        if next_chunk < num_chunks:
            deadline = time.monotonic() + TICK_BUDGET_S
            while next_chunk < num_chunks and time.monotonic() < deadline:
                self._enqueue_chunk(batch_id, lines, next_chunk)
                next_chunk += 1
                fields = self.batches.fields(batch_id)
                if fields.get("stop") or int(fields["next_chunk"]) != next_chunk:
                    return True
                self.hold(batch_id)
            return True
        counts = self.batches.counts(batch_id)
        if ended_lines(counts) < int(fields["total"]):
            return False
        now = int(time.time())
        if self.batches.transition(
            batch_id, ("in_progress",), status="finalizing", finalizing_at=now
        ):
            self._finalize(batch_id, self.batches.fields(batch_id), "completed")
        return False

    def _enqueue_chunk(self, batch_id: str, lines: BatchLines, index: int) -> None:
        parsed = next(lines.chunks(index, index + 1), [])
        valid = [p for p in parsed if p.request is not None]
        job_ids = [lines.job_id(p) for p in valid]
        # A chunk redone after a gateway died: its jobs that exist are left as they are (a
        # resubmission through Client.enqueue would re-run a failed one and count it twice).
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(Job.key_for(job_id), result_key(job_id))
        exists = pipe.execute() if job_ids else []
        todo = [p.request for p, e in zip(valid, exists) if not e]
        it = iter(todo)
        while part := list(islice(it, ENQUEUE_CHUNK)):
            self.client.enqueue(part, id_namespace=batch_id, batch_id=batch_id)
        ref = batch_ref(self.redis, batch_id)
        keys = [batch_key(ref), batch_counts_key(ref)]
        self._commit(keys=keys, args=[index, len(parsed), len(parsed) - len(valid)])

    def _stopping(self, batch_id: str, fields: dict[str, str]) -> bool:
        """Cancel a stopping batch's lines (cancel or expiry), then end it once they ended."""
        stop, status = fields["stop"], fields["status"]
        final_status = "cancelled" if stop == "cancelled" else "expired"
        if status == "validating":  # cancelled before any line was enqueued: no files
            self._end(batch_id, ("validating",), final_status, {})
            return False
        lines = self._lines(fields)
        if fields.get("cancel_sent") != "1":
            renew = self._renewer(batch_id)
            for chunk in lines.chunks(0, int(fields["next_chunk"])):
                job_ids = [j for j in map(lines.job_id, chunk) if j is not None]
                pipe = self.redis.pipeline(transaction=False)
                for job_id in job_ids:
                    pipe.hget(Job.key_for(job_id), "status")
                for job_id, st in zip(job_ids, pipe.execute() if job_ids else []):
                    if st is not None and st.decode() in LIVE_STATUSES:
                        self.client.cancel(job_id)
                renew()
            self.redis.hset(batch_key(batch_ref(self.redis, batch_id)), "cancel_sent", "1")
        counts = self.batches.counts(batch_id)
        if ended_lines(counts) < int(fields.get("lines_done") or 0):
            return False
        never_enqueued = int(fields["total"]) - int(fields.get("lines_done") or 0)
        if never_enqueued > 0 and fields.get("unrun_counted") != "1":
            pipe = self.redis.pipeline()
            ref = batch_ref(self.redis, batch_id)
            pipe.hincrby(batch_counts_key(ref), "canceled", never_enqueued)
            pipe.hset(batch_key(ref), "unrun_counted", "1")
            pipe.execute()
        self._finalize(batch_id, fields, final_status)
        return False

    def _finalize(self, batch_id: str, fields: dict[str, str], final_status: str) -> None:
        """Size the output and error files from the results, then end the batch."""
        lines = self._lines(fields)
        renew = self._renewer(batch_id)
        sizes = {False: [0, 0], True: [0, 0]}
        created = int(fields["created_at"])
        for is_error, line in output_lines(lines, fields.get("stop", ""), created, tick=renew):
            sizes[is_error][0] += 1
            sizes[is_error][1] += len(line)
        extra = {}
        for is_error, name in ((False, "output_file_id"), (True, "error_file_id")):
            n, size = sizes[is_error]
            if n:
                extra[name] = self._output_file(fields, "error" if is_error else "output", size)
        allowed = ("finalizing",) if final_status == "completed" else ("in_progress", "cancelling")
        self._end(batch_id, allowed, final_status, extra)

    def _end(self, batch_id: str, allowed: tuple[str, ...], status: str, extra: dict) -> None:
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
        if self.batches.transition(
            batch_id, allowed, status=status, **{stamp[status]: int(time.time())}, **extra
        ):
            BATCHES_ENDED.labels(status=status).inc()
        self.redis.srem(ACTIVE_BATCHES, batch_id)
        self._release(keys=[batch_lease_key(batch_id)], args=[self.token])
        self._held.discard(batch_id)

    def _output_file(self, fields: dict[str, str], kind: str, size: int) -> str:
        """The record of an output or error file (its content is made when it is read)."""
        digest = hashlib.sha256(f"{fields['id']}:{kind}".encode()).hexdigest()[:24]
        file_id = f"file-{digest}"
        now = int(time.time())
        ttl = self.config.result_ttl  # the results it is made from expire then
        record = {
            "id": file_id,
            "bytes": size,
            "created_at": now,
            "filename": f"{fields['id']}_{kind}.jsonl",
            "purpose": "batch_output",
            "owner": fields["owner"],
            "kind": kind,
            "batch_id": fields["id"],
            "expires_at": now + ttl,
        }
        pipe = self.redis.pipeline()
        pipe.hset(file_key(file_id), mapping=record)
        pipe.expire(file_key(file_id), ttl)
        pipe.zadd(files_index_key(fields["owner"]), {file_id: time.time_ns() // 1000})
        pipe.execute()
        return file_id


class LeaseLost(RuntimeError):
    """Another gateway took the batch while this one worked on it: stop at once."""

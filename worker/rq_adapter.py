"""The only place that knows RQ's key layout and entry formats, with rq_scripts.py (its Lua),
rq_claim.py (a dequeued job's raw fields) and rq_calls.py (how scripts are sent).

A worker talks to RQ's state only through `RQAdapter`: each call is one EVALSHA of a fenced
script (rq_scripts.py), or builds one for a batch. Nothing here calls RQ code that could import
a callback, follow a dependency or send a webhook: RQ's classes are used only to read job data
as JSON (`Job` with `JSONSerializer`, never fetched) and to format dates as RQ does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import zlib
from base64 import b64encode
from datetime import UTC, datetime
from typing import Any

import redis
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from producer.keys import STREAM_MAXLEN, worker_key
from worker.fair_queue import DEFAULT_AGING_SECONDS, DEFAULT_MAX_WAIT_SECONDS, publish_weights
from worker.rq_calls import Command, ScriptCall, ScriptRunner
from worker.rq_claim import Claim

__all__ = ["Claim", "Command", "RQAdapter", "ScriptCall", "ScriptRunner", "crash_reason"]

# How many stale queue entries one dequeue call may skip before it gives up for this round.
MAX_POPS_PER_DEQUEUE = 32
# How many expired leases one reaper call handles per queue (the rest on the next call).
REAP_LIMIT = 100
# RQ's Result.Type values.
RESULT_SUCCESSFUL, RESULT_FAILED = 1, 2
# Where RQ's registries are named in end scripts, by final status.
REGISTRY = {"finished": "finished", "failed": "failed", "canceled": "canceled"}


def rq_date(t: float) -> str:
    """A Unix time in RQ's job-hash date format."""
    return utcformat(datetime.fromtimestamp(t, UTC))


def rq_exc_string(message: str) -> str:
    """An error message as RQ stores `exc_string` in its result stream (zlib, then base64)."""
    return b64encode(zlib.compress(message.encode())).decode()


def queue_key(name: str) -> str:
    """RQ's list key of a queue."""
    return f"rq:queue:{name}"


class RQAdapter:
    """RQ's view of one worker: registration, dequeue, leases, job endings, the reaper."""

    def __init__(
        self,
        connection: redis.Redis,
        name: str,
        queues: list[str],
        *,
        lease_ttl: int,
        result_ttl: int,
        stream_ttl: int,
        max_crashes: int,
        aging_seconds: float = DEFAULT_AGING_SECONDS,
        max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS,
    ) -> None:
        self.connection = connection
        self.name = name
        self.queues = queues
        self.lease_ttl = lease_ttl
        self.result_ttl = result_ttl
        self.stream_ttl = stream_ttl
        self.max_crashes = max_crashes
        self.aging_seconds = aging_seconds
        self.max_wait_seconds = max_wait_seconds
        self.scripts = ScriptRunner(connection)
        self.key = f"rq:worker:{name}"
        self._execution_seq = 0
        self._execution_prefix = os.urandom(6).hex()

    # --- registration -------------------------------------------------------------------------

    def register(self) -> bool:
        """Register in `rq:workers` (what `rq info` lists); False if a live worker has the name."""
        t = time.time()
        fields = {
            "birth": rq_date(t),
            "last_heartbeat": rq_date(t),
            "pagedq_heartbeat": t,
            "queues": ",".join(self.queues),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "ip_address": "",
            "version": "pagedq",
            "python_version": sys.version,
            "state": "idle",
        }
        pairs = [x for kv in fields.items() for x in kv]
        keys = [self.key, "rq:workers", *(f"rq:workers:{q}" for q in self.queues)]
        args = [t, self.lease_ttl, self.worker_ttl, *pairs, "--", *map(queue_key, self.queues)]
        return bool(self.scripts.call(ScriptCall("register", keys, args)))

    def name_in_use(self) -> bool:
        """True when a live worker (heartbeat younger than a lease) is registered under the
        name: the same test the register script makes, read-only, to fail fast at start-up."""
        death, heartbeat = self.connection.hmget(self.key, "death", "pagedq_heartbeat")
        if not self.connection.exists(self.key) or death is not None:
            return False
        return heartbeat is None or time.time() - float(heartbeat) < self.lease_ttl

    @property
    def worker_ttl(self) -> int:
        """Seconds the worker's registration outlives its last heartbeat."""
        return self.lease_ttl + 60

    def unregister(self) -> None:
        """Remove the worker from RQ's registry and its pagedq status key."""
        with self.connection.pipeline(transaction=True) as pipe:
            pipe.srem("rq:workers", self.key)
            for q in self.queues:
                pipe.srem(f"rq:workers:{q}", self.key)
            pipe.delete(self.key, worker_key(self.name))
            pipe.execute()

    def all_queues(self) -> list[str]:
        """The worker's base queues and every priority/tenant sub-queue RQ knows of them."""
        prefixes = tuple(queue_key(q) + ":" for q in self.queues)
        subs = sorted(
            k.decode()[len("rq:queue:") :]
            for k in self.connection.smembers("rq:queues")
            if k.decode(errors="replace").startswith(prefixes)
        )
        return [*self.queues, *subs]

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Publish tenant weights for the fair pick (shared by all workers; last writer wins)."""
        publish_weights(self.connection, self.queues, weights)

    # --- dequeue ------------------------------------------------------------------------------

    def dequeue(self) -> Claim | None:
        """Pop the first runnable job of the worker's queues and mark it started, atomically."""
        self._execution_seq += 1
        execution = f"{self._execution_prefix}{self._execution_seq:x}"
        t = time.time()
        keys = [queue_key(q) for q in self.queues]
        args = [
            t,
            self.lease_ttl,
            self.name,
            execution,
            rq_date(t),
            MAX_POPS_PER_DEQUEUE,
            self.aging_seconds,
            self.max_wait_seconds,
        ]
        reply = self.scripts.call(ScriptCall("dequeue", keys, args))
        if not reply:
            return None
        queue, job_id, attempt, data, enqueued_at, timeout, canceled, status = reply
        return Claim(
            job_id=job_id.decode(),
            queue=queue.decode(),
            execution=execution,
            attempt=int(attempt),
            data=data,
            enqueued_at=enqueued_at.decode(errors="replace"),
            timeout=timeout.decode(errors="replace"),
            canceled=bool(canceled),
            started_at=t,
            status_was=status.decode(errors="replace"),
        )

    # --- ending jobs (fenced) -----------------------------------------------------------------

    def end_call(
        self,
        claim: Claim,
        status: str,
        result: dict[str, Any],
        final_entry: dict[str, str],
        summary: dict[str, Any] | None = None,
        *,
        stream_ttl_set: bool = False,
    ) -> ScriptCall:
        """The fenced script that ends a held job as finished, failed or canceled.

        RQ's result entry gets a small `summary` (finished) or the error (failed); the full
        result JSON goes to `pagedq:result:{id}` only. `stream_ttl_set`: this run's entries
        already gave the stream its TTL. Reply 1 = ended, 0 = lease lost.
        """
        t = time.time()
        args = [claim.job_id, claim.queue, claim.execution]
        args += self._end_args(claim, status, result, final_entry, summary, t)
        if stream_ttl_set:
            args[9] = 0  # END's ARGV[10], stream_ttl
        return ScriptCall("end", [self.key], args)

    def requeue_call(
        self, claim: Claim, *, count_crash: bool, result: dict[str, Any], reason: str
    ) -> ScriptCall:
        """The fenced script that puts a held job back at the front of its queue.

        With `count_crash`, the job's crash count grows; at `max_crashes` it fails instead,
        with `reason`. Reply 1 = requeued, 2 = failed, 0 = lease lost.
        """
        t = time.time()
        final = {"event": "error", "error": reason}
        failed = {**result, "status": "failed", "error": reason}
        args = [claim.job_id, claim.queue, claim.execution, int(count_crash), self.max_crashes]
        args += self._end_args(claim, "failed", failed, final, None, t)
        return ScriptCall("requeue", [self.key], args)

    def _end_args(
        self,
        claim: Claim,
        status: str,
        result: dict[str, Any],
        final_entry: dict[str, str],
        summary: dict[str, Any] | None,
        t: float,
    ) -> list[Any]:
        rq_fields: dict[str, Any] = {}
        if status == "finished":
            value = b64encode(JSONSerializer.dumps(summary or {})).decode()
            rq_fields = {"type": RESULT_SUCCESSFUL, "return_value": value}
        elif status == "failed":
            error = result.get("error") or "failed"
            rq_fields = {"type": RESULT_FAILED, "exc_string": rq_exc_string(error)}
        if rq_fields:
            rq_fields |= {
                "worker_name": self.name,
                "execution_id": claim.execution,
                "execution_started_at": claim.started_at,
                "execution_ended_at": t,
            }
        rq_pairs = [x for kv in rq_fields.items() for x in kv]
        final_pairs = [x for kv in final_entry.items() for x in kv]
        return [
            status,
            REGISTRY[status],
            rq_date(t),
            t + self.result_ttl,
            self.result_ttl,
            json.dumps(result),
            self.stream_ttl,
            STREAM_MAXLEN,
            len(rq_pairs),
            len(final_pairs),
            *rq_pairs,
            *final_pairs,
        ]

    def stream_call(self, entries: list[tuple[Claim, dict[str, str], bool]]) -> ScriptCall:
        """One fenced script appending a step's entries: (claim, fields, set_ttl) per job.

        Reply: the job ids whose lease was lost (their entries were not written).
        """
        args: list[Any] = [STREAM_MAXLEN, self.stream_ttl]
        for claim, fields, set_ttl in entries:
            pairs = [x for kv in fields.items() for x in kv]
            args += [claim.job_id, claim.execution, int(set_ttl), len(pairs), *pairs]
        return ScriptCall("stream", [], args)

    def cancel_check(self, job_ids: list[str]) -> Command:
        """MGET of the cancel keys of `job_ids` (a fallback for missed cancel messages)."""
        return Command("MGET", [f"pagedq:cancel:{j}" for j in job_ids])

    # --- leases -------------------------------------------------------------------------------

    def heartbeat_call(self, claims: list[Claim], state: str, status: dict[str, Any]) -> ScriptCall:
        """Renew every held lease and the worker's registration; reply: members whose lease is
        gone (another worker's reaper took the job)."""
        t = time.time()
        args: list[Any] = [
            t + self.lease_ttl,
            self.worker_ttl,
            t,
            rq_date(t),
            state,
            json.dumps(status),
            max(5, self.lease_ttl),
        ]
        for c in claims:
            args += [c.queue, c.member]
        return ScriptCall("heartbeat", [self.key, worker_key(self.name)], args)

    def reap(self) -> tuple[list[str], list[str]]:
        """Requeue (or fail, after max_crashes) jobs whose lease expired; (requeued, failed)."""
        t = time.time()
        reason = crash_reason(self.max_crashes)
        args = [
            t,
            self.max_crashes,
            rq_date(t),
            self.result_ttl,
            rq_exc_string(reason),
            reason,
            self.stream_ttl,
            STREAM_MAXLEN,
            REAP_LIMIT,
        ]
        keys = [f"rq:wip:{q}" for q in self.all_queues()]
        requeued, failed = self.scripts.call(ScriptCall("reap", keys, args))
        return [j.decode() for j in requeued], [j.decode() for j in failed]


def crash_reason(max_crashes: int) -> str:
    """The error of a job failed because workers kept dying while it ran."""
    return (
        f"job was in flight during {max_crashes} worker crashes (--max-crashes {max_crashes}); "
        "not retried"
    )

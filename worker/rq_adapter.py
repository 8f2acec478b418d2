"""RQ's view of one worker: registration, dequeue, leases, job endings, the reaper.

A worker talks to RQ's state only through `RQAdapter`: each call is one EVALSHA of a fenced
script (worker/rq_scripts.py), or builds one for a batch (`ScriptCall`). With a sharded queue
(producer/contract/shards.py) a call about jobs of several shards is one call per shard
(`SplitCall`), each within one hash slot, and a dequeue first asks the shards which one holds
the best head. Nothing here calls RQ code that could import a callback, follow a dependency or
send a webhook; from RQ it takes only its date format.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import zlib
from base64 import b64encode
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import redis
from rq.utils import utcformat

from producer.connection import is_cluster
from producer.contract.keys import (
    EXECUTION_PREFIX_CHARS,
    RQ_QUEUES,
    RQ_RESULT_FAILED,
    RQ_RESULT_SUCCESSFUL,
    RQ_WORKERS,
    STREAM_MAXLEN,
    WAKE_RETAIN_MS,
    WAKE_TTL_S,
    bell_key,
    cancel_key,
    fence_key,
    rq_job_key,
    rq_queue_key,
    rq_queue_name,
    rq_wip_key,
    rq_worker_key,
    rq_workers_of_key,
    staged_result_key,
    weights_key,
)
from producer.contract.lua import LuaScript
from producer.contract.shards import hash_tag
from producer.contract.stream import encode_inline, inline_entry, is_inline, takes_deltas
from worker.claim import Claim
from worker.redis_link import Call, Command, ScriptCall, SplitCall
from worker.rq_scripts import (
    DEFAULT_AGING_SECONDS,
    DEFAULT_MAX_WAIT_SECONDS,
    DEQUEUE,
    END,
    ENDING_FIELDS,
    HEARTBEAT,
    PEEK,
    REAP,
    REGISTER,
    REQUEUE,
    STEP,
    STREAM,
)

# How many stale queue entries one dequeue call may skip before it gives up for this round.
MAX_POPS_PER_DEQUEUE = 32
# Which jobs get an entry in RQ's result stream (what RQ's `Job.return_value()` reads; about
# 4.7 KB of Redis memory each, a stream's smallest size): "plain", only jobs a plain RQ
# producer enqueued (pagedq's own clients read the result key); "all", every job.
RQ_RESULTS_CHOICES = ("plain", "all")
# Shards a sharded dequeue asks for their best head (the next ones in turn): every dequeue asks
# each of them, so with more shards than this each primary is asked by a share of the dequeues
# only (measured on one Redis, 2,000 jobs taken 8 at a time: 32.9 us of Redis CPU per job
# unsharded, 69.5 us with 3 shards, the peeks included).
MAX_PEEKS = 4
# How many expired leases one reaper call handles per queue (the rest on the next call).
REAP_LIMIT = 100
# Hubs whose wake-stream renewal a worker remembers before it forgets the renewed ones.
MAX_WAKES_TRACKED = 1024


def rq_date(t: float) -> str:
    """A Unix time in RQ's job-hash date format."""
    return utcformat(datetime.fromtimestamp(t, UTC))


def rq_exc_string(message: str) -> str:
    """An error message as RQ stores `exc_string` in its result stream (zlib, then base64)."""
    return b64encode(zlib.compress(message.encode())).decode()


def crash_reason(max_crashes: int) -> str:
    """The error of a job failed because workers kept dying while it ran."""
    return (
        f"job was in flight during {max_crashes} worker crashes (--max-crashes {max_crashes}); "
        "not retried"
    )


# What json.dumps escapes in a string, beside non-ASCII characters.
_JSON_ESCAPED = re.compile(r'["\\\x00-\x1f\x7f]')


def _hub_ids(wake: str, job_ids: Iterable[str]) -> str:
    """A hub's job ids as STREAM takes them beside its entries: joined by spaces, or '' for a
    hub of deltas (its wake entry lists no jobs), whose ids STREAM reads from the entries' keys
    only when a fence moved: some 33 bytes less per entry for Lua to hash."""
    joined = " ".join(job_ids)
    # An id that JSON escapes would not read back from the keys as it is.
    plain = joined.isascii() and not _JSON_ESCAPED.search(joined)
    return "" if takes_deltas(wake) and plain else joined


def _pairs(fields: Mapping[str, Any]) -> list[Any]:
    return [x for kv in fields.items() for x in kv]


def _call(
    script: LuaScript,
    keys: Mapping[str, str] | None = None,
    args: Mapping[str, Any] | None = None,
    *,
    rest_keys: list[str] | tuple = (),
    rest: list[Any] | tuple = (),
) -> ScriptCall:
    k, a = script.keys_and_args(keys, args, rest_keys=rest_keys, rest=rest)
    return ScriptCall(script, k, a)


def _by_shard(items: list, tag_of) -> dict[str, list[int]]:
    """Indexes of `items` grouped by their shard's hash tag, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(tag_of(item), []).append(i)
    return groups


def _in_order(groups: dict[str, list[int]], n: int):
    """A merge putting per-group reply lists back in the order of the items they were for."""

    def merge(replies: list) -> list:
        out: list = [None] * n
        for indexes, reply in zip(groups.values(), replies, strict=True):
            for i, r in zip(indexes, reply, strict=True):
                out[i] = r
        return out

    return merge


def _concat(replies: list) -> list:
    return [x for reply in replies for x in (reply or [])]


class RQAdapter:
    """Builds the script calls of one worker; `run` is the link's runner (ScriptRunner.call)."""

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
        rq_results: str = "plain",
    ) -> None:
        if rq_results not in RQ_RESULTS_CHOICES:
            raise ValueError(f"rq_results: {rq_results!r}; allowed: {list(RQ_RESULTS_CHOICES)}")
        self.connection = connection
        self.name = name
        self.queues = queues
        self.lease_ttl = lease_ttl
        self.result_ttl = result_ttl
        self.stream_ttl = stream_ttl
        self.max_crashes = max_crashes
        self.aging_seconds = aging_seconds
        self.max_wait_seconds = max_wait_seconds
        self.rq_results = rq_results
        self.key = rq_worker_key(name)
        # The worker's queues by shard (hash tag; '' for an unsharded queue), each shard's
        # model queue first; dequeues start at the next shard each time.
        self.shards: dict[str, list[str]] = {}
        for q in queues:
            self.shards.setdefault(hash_tag(q), []).append(q)
        # Sharded (tagged): the worker's RQ hash is in another slot than any job, so the
        # scripts do not write its counters (`rq info`'s job counts per worker).
        self.counters = "" in self.shards and len(self.shards) == 1
        self._next_shard = 0
        self._execution_seq = 0
        self._execution_prefix = os.urandom(EXECUTION_PREFIX_CHARS // 2).hex()
        # queue -> the value of this worker's lease fence there that its STREAM calls last saw
        self._fences: dict[str, str] = {}
        # wake id -> when this worker renews that hub's wake stream TTL next (wake_args)
        self._wake_renew_at: dict[str, float] = {}

    def wake_args(self, wakes: Iterable[str | None]) -> dict[str, Any]:
        """The wake-stream arguments of a call writing to the hubs `wakes`: the oldest entry id
        an inline stream keeps (this clock's ms less WAKE_RETAIN_MS), and the TTL to renew,
        0 unless one of them was not renewed by this worker within a quarter of the TTL (its
        first call to a hub renews it). A stream that lost its TTL (evicted and written again)
        gets it back at this worker's next renewal."""
        now = time.time()
        ttl = 0
        for wake in wakes:
            if wake and self._wake_renew_at.get(wake, 0.0) <= now:
                if len(self._wake_renew_at) >= MAX_WAKES_TRACKED:
                    self._wake_renew_at = {w: t for w, t in self._wake_renew_at.items() if t > now}
                self._wake_renew_at[wake] = now + WAKE_TTL_S / 4
                ttl = WAKE_TTL_S
        return {"wake_minid": str(int(now * 1000) - WAKE_RETAIN_MS), "wake_ttl": ttl}

    @property
    def worker_ttl(self) -> int:
        """Seconds the worker's registration outlives its last heartbeat."""
        return self.lease_ttl + 60

    # --- registration -------------------------------------------------------------------------

    def register_call(self) -> SplitCall:
        """Register in RQ's worker set (what `rq info` lists); the reply is 0 if a live worker
        has the name. The worker hash is written by a script, then added to RQ's sets."""
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
        register = _call(
            REGISTER,
            {"worker": self.key},
            {
                "now": t,
                "lease_ttl": self.lease_ttl,
                "key_ttl": self.worker_ttl,
                "n_fields": len(fields) * 2,
            },  # fmt: skip
            rest=_pairs(fields),
        )
        sets = [Command("SADD", [RQ_WORKERS, self.key])]
        sets += [Command("SADD", [rq_workers_of_key(q), self.key]) for q in self.queues]
        sets.append(Command("SADD", [RQ_QUEUES, *map(rq_queue_key, self.queues)]))
        return SplitCall([register, *sets], merge=lambda replies: replies[0])

    def name_in_use(self) -> bool:
        """True when a live worker (heartbeat younger than a lease) is registered under the
        name: the register script's test, read-only."""
        death, heartbeat = self.connection.hmget(self.key, "death", "pagedq_heartbeat")
        if not self.connection.exists(self.key) or death is not None:
            return False
        return heartbeat is None or time.time() - float(heartbeat) < self.lease_ttl

    def predecessor_gone(self) -> bool:
        """True when the worker registered under this name provably died: it ran on this host
        and its PID is no longer running (or is this process's own, as in a restarted
        container)."""
        host, pid = self.connection.hmget(self.key, "hostname", "pid")
        if host is None or pid is None or host.decode() != socket.gethostname():
            return False
        try:
            pid_number = int(pid)
        except ValueError:
            return False
        if pid_number == os.getpid():
            return True
        try:
            os.kill(pid_number, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # running, as another user
            return False
        return False

    def unregister(self) -> None:
        """Remove the worker from RQ's registry."""
        with self.connection.pipeline(transaction=not is_cluster(self.connection)) as pipe:
            pipe.srem(RQ_WORKERS, self.key)
            for q in self.queues:
                pipe.srem(rq_workers_of_key(q), self.key)
            pipe.delete(self.key)
            pipe.execute()

    def all_queues(self) -> list[str]:
        """The worker's base queues and every priority/tenant sub-queue RQ knows of them."""
        prefixes = tuple(rq_queue_key(q) + ":" for q in self.queues)
        subs = sorted(
            rq_queue_name(k.decode())
            for k in self.connection.smembers(RQ_QUEUES)
            if k.decode(errors="replace").startswith(prefixes)
        )
        return [*self.queues, *subs]

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Publish tenant weights once per root queue (shared by all workers; last writer wins)."""
        keys = sorted({weights_key(q) for q in self.queues})
        if weights and keys:
            with self.connection.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hset(key, mapping={t: str(w) for t, w in weights.items()})
                pipe.execute()

    # --- dequeue ------------------------------------------------------------------------------

    def dequeue_call(
        self, max_jobs: int = 1, ahead: int = 0
    ) -> tuple[ScriptCall | SplitCall, float]:
        """The script popping up to `max_jobs` runnable jobs, and up to `ahead` bulk jobs more
        from a queue deep enough (DEQUEUE's comment), and marking them started, with the
        time it starts them at; `claims` reads its reply. Sharded: every shard is asked for the
        best aged priority of its heads (PEEK, one round trip), then jobs are taken from the
        best shard up to the next best's priority, so priorities and aging hold across shards
        as on one queue; ties go round-robin. With more than MAX_PEEKS shards, the next
        MAX_PEEKS in turn are asked."""
        tags = list(self.shards)
        if len(tags) == 1:
            return self._dequeue_call(tags[0], max_jobs, ahead), time.time()
        start = self._next_shard % len(tags)
        self._next_shard += 1
        order = [tags[(start + i) % len(tags)] for i in range(min(len(tags), MAX_PEEKS))]
        peeks = [
            _call(
                PEEK,
                args={"aging_s": self.aging_seconds, "max_pops": MAX_POPS_PER_DEQUEUE},
                rest_keys=[rq_queue_key(q) for q in self.shards[tag]],
            )
            for tag in order
        ]

        def then(replies: list) -> ScriptCall | None:
            heads = sorted(
                (float(r[0]), i) for i, r in enumerate(replies) if r
            )  # stable: ties keep the round-robin order
            if not heads:
                return None
            limit = heads[1][0] if len(heads) > 1 else None
            return self._dequeue_call(order[heads[0][1]], max_jobs, ahead, limit)

        return SplitCall(peeks, then=then), time.time()

    def _dequeue_call(
        self, tag: str, max_jobs: int, ahead: int = 0, max_priority: float | None = None
    ) -> ScriptCall:
        self._execution_seq += 1
        t = time.time()
        call = _call(
            DEQUEUE,
            args={
                "lease_deadline": f"{t + self.lease_ttl:.3f}",
                "worker_name": self.name,
                # Each job's execution id (fencing token) is this, then its number in the call.
                "execution": f"{self._execution_prefix}{self._execution_seq:x}-",
                "started_at": rq_date(t),
                "max_jobs": max(0 if ahead > 0 else 1, max_jobs),
                "ahead": max(0, ahead),
                "max_pops": MAX_POPS_PER_DEQUEUE,
                "aging_s": self.aging_seconds,
                "max_wait_s": self.max_wait_seconds,
                "max_priority": "" if max_priority is None else max_priority,
            },
            rest_keys=[rq_queue_key(q) for q in self.shards[tag]],
        )
        return call

    @staticmethod
    def claims(reply: Any, started_at: float) -> list[Claim]:
        """The Claims of a dequeue reply (empty: the queues were empty)."""
        out = []
        for row in reply or []:
            queue, job_id, execution, attempt, data, enqueued_at, timeout, canceled = row[:8]
            status, plain, bulk, wake = row[8:12]
            out.append(
                Claim(
                    job_id=job_id.decode(),
                    queue=queue.decode(),
                    execution=execution.decode(),
                    attempt=int(attempt),
                    data=data,
                    enqueued_at=enqueued_at.decode(errors="replace"),
                    timeout=timeout.decode(errors="replace"),
                    canceled=bool(canceled),
                    started_at=started_at,
                    status_was=status.decode(errors="replace"),
                    plain=bool(plain),
                    bulk=bool(bulk),
                    wake=wake.decode(errors="replace"),
                )
            )
        return out

    # --- ending jobs (fenced) -----------------------------------------------------------------

    def end_call(
        self,
        claim: Claim,
        status: str,
        result_json: str,
        usage: tuple[int, int],
        final_entry: dict[str, str],
        rq_return_value: dict[str, Any] | None = None,
        *,
        error: str | None = None,
        stream_ttl_set: bool = False,
        staged: bool = False,
        entries: list[dict[str, str]] | tuple = (),
    ) -> ScriptCall:
        """The fenced script that ends a held job as finished, failed or canceled; calls of
        one moment merge into one (`merge_ends`). With `staged`, the result is not passed:
        `stage_result(claim, result_json)` must run before it in the same batch.

        `usage` is the result's (prompt_tokens, completion_tokens). `final_entry` is the
        stream's done/error entry, {} for a job that does not stream. RQ's result entry, for
        the jobs that get one (`rq_results`), holds `rq_return_value` (a small summary;
        finished) or `error` (failed); the full result JSON goes to the result key only.
        `stream_ttl_set`: this run's entries already gave the stream its TTL. `entries`: the
        job's entries not written yet, for a job of an inline hub only: they go into the hub's
        wake entry with the final one (fenced by this call), not through a STREAM call.
        Reply: [1] = ended, [0] = lease lost.
        """
        rest = self._ending(
            claim, status, "" if staged else result_json, usage, final_entry, rq_return_value,
            error, stream_ttl_set, entries,
        )  # fmt: skip
        return _call(
            END,
            args={"maxlen": STREAM_MAXLEN, "counters": int(self.counters)}
            | self.wake_args([claim.wake] if final_entry else []),
            rest_keys=[rq_job_key(claim.job_id), *self._worker_keys()],
            rest=rest,
        )

    def stage_result(self, claim: Claim, result_json: str) -> Command:
        """The SET of a result ahead of its END (`end_call(staged=True)`, in the same batch),
        which renames it to the result key: the JSON never enters Lua, where every string is
        hashed byte by byte and copied twice (~25,000 instructions for 3 KB). Its TTL is the
        result's, which the rename keeps."""
        key = staged_result_key(claim.job_id, claim.execution)
        return Command("SET", [key, result_json, "EX", self.result_ttl])

    def bell_keys(self) -> list[str]:
        """The doorbells of the base queues this worker serves, every shard's
        (worker/doorbell.py)."""
        return [bell_key(q) for queues in self.shards.values() for q in queues]

    def _worker_keys(self) -> list[str]:
        return [self.key] if self.counters else []

    def merge_ends(self, calls: list[ScriptCall]) -> list[ScriptCall | SplitCall]:
        """`end_call`s as one call (its reply lists theirs in order), one script per shard;
        [] for none."""
        if len(calls) <= 1:
            return list(calls)
        groups = _by_shard(calls, lambda c: hash_tag(c.keys[0]))
        named = len(END.args)
        ttl = END.args.index("wake_ttl")

        def args(indexes: list[int]) -> list[Any]:
            first = list(calls[indexes[0]].args[:named])
            # Any of the endings may be the one that renews its hub's TTL.
            first[ttl] = max(calls[i].args[ttl] for i in indexes)
            return [*first, *(a for i in indexes for a in calls[i].args[named:])]

        merged = [
            ScriptCall(END, [*(calls[i].keys[0] for i in indexes), *self._worker_keys()],
                       args(indexes))
            for indexes in groups.values()
        ]  # fmt: skip
        if len(merged) == 1:
            return merged
        return [SplitCall(merged, merge=_in_order(groups, len(calls)))]

    def requeue_call(
        self, claim: Claim, *, count_crash: bool, result_json: str, reason: str
    ) -> ScriptCall:
        """The fenced script that puts a held job back at the front of its queue.

        With `count_crash`, the job's crash count grows; at `max_crashes` it fails instead with
        `reason`, `result_json` (a failed result) as its result. Reply 1 = requeued, 2 = failed,
        0 = lease lost.
        """
        final = {"event": "error", "error": reason}
        rest = self._ending(claim, "failed", result_json, (0, 0), final, None, reason, False, ())
        crash = {"count_crash": int(count_crash), "max_crashes": self.max_crashes}
        return _call(
            REQUEUE,
            args=crash
            | {"maxlen": STREAM_MAXLEN, "counters": int(self.counters)}
            | self.wake_args([claim.wake]),
            rest_keys=[rq_job_key(claim.job_id), *self._worker_keys()],
            rest=rest,
        )

    def _ending(
        self,
        claim: Claim,
        status: str,
        result_json: str,
        usage: tuple[int, int],
        final_entry: dict[str, str],
        rq_return_value: dict[str, Any] | None,
        error: str | None,
        stream_ttl_set: bool,
        entries: list[dict[str, str]] | tuple,
    ) -> list[Any]:
        t = time.time()
        inline = ""
        if final_entry and is_inline(claim.wake):
            # The hub's JSON member of this job, its final entry last.
            by_job = {claim.job_id: [*(inline_entry(claim.wake, e) for e in entries), final_entry]}
            inline = encode_inline(by_job)[1:-1]
            final_entry = {}
        elif entries:
            raise ValueError("entries go with an end only for a job of an inline hub")
        rq_fields: dict[str, Any] = {}
        if claim.plain or self.rq_results == "all":
            if status == "finished":
                value = b64encode(json.dumps(rq_return_value or {}).encode()).decode()
                rq_fields = {"type": RQ_RESULT_SUCCESSFUL, "return_value": value}
            elif status == "failed":
                exc = rq_exc_string(error or "failed")
                rq_fields = {"type": RQ_RESULT_FAILED, "exc_string": exc}
        if rq_fields:
            rq_fields |= {
                "worker_name": self.name,
                "execution_id": claim.execution,
                "execution_started_at": claim.started_at,
                "execution_ended_at": t,
            }
        fields = {
            "job_id": claim.job_id,
            "queue": claim.queue,
            "execution": claim.execution,
            "status": status,
            "ended_at": rq_date(t),
            "score": t + self.result_ttl,
            "ttl": self.result_ttl,
            "result": result_json,
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "stream_ttl": 0 if stream_ttl_set else self.stream_ttl,
            "inline": inline,
            "n_rq": len(rq_fields) * 2,
            "n_final": len(final_entry) * 2,
        }
        assert tuple(fields) == ENDING_FIELDS
        return [*fields.values(), *_pairs(rq_fields), *_pairs(final_entry)]

    def stream_call(
        self, entries: list[tuple[Claim, dict[str, str], bool]]
    ) -> ScriptCall | SplitCall:
        """One fenced script appending a step's entries: (claim, fields, set_ttl) per job (one
        per shard, when sharded). The entries of a job of an inline hub go, as one value, into
        the hub's wake entry (producer/contract/stream.py).

        Reply: read it with `stream_lost` (the job ids whose lease was lost: their entries were
        not written).
        """
        groups = _by_shard(entries, lambda e: hash_tag(e[0].job_id))
        calls = []
        for indexes in groups.values():
            queues: dict[str, int] = {}
            streams: list[Any] = []  # n_streams jobs' arguments
            n_streams = 0
            hubs: dict[str, dict[str, tuple[str, list[dict[str, str]]]]] = {}
            wakes: set[str] = set()  # every hub told of this call, inline or not
            for claim, fields, set_ttl in (entries[i] for i in indexes):
                if claim.wake:
                    wakes.add(claim.wake)
                q = queues.setdefault(claim.queue, len(queues) + 1)
                lease = f"{q}:{claim.execution.removeprefix(self._execution_prefix)}"
                if is_inline(claim.wake):
                    job = hubs.setdefault(claim.wake, {}).setdefault(claim.job_id, (lease, []))
                    job[1].append(inline_entry(claim.wake, fields))
                    continue
                pairs = _pairs(fields)
                streams += [claim.job_id, lease, claim.wake, int(set_ttl), len(pairs), *pairs]
                n_streams += 1
            keys: list[str] = []
            rest: list[Any] = []
            for queue in queues:
                keys += [rq_wip_key(queue), fence_key(queue, self._execution_prefix)]
                rest += [queue, self._fences.get(queue, "")]
            rest += streams
            for wake, jobs in hubs.items():
                data = encode_inline({job_id: e for job_id, (_, e) in jobs.items()})
                leases = " ".join(lease for lease, _ in jobs.values())
                rest += [wake, data, _hub_ids(wake, jobs), leases]
            calls.append(_call(STREAM, args={"maxlen": STREAM_MAXLEN,
                                             "stream_ttl": self.stream_ttl,
                                             "prefix": self._execution_prefix,
                                             "n_queues": len(queues),
                                             "n_streams": n_streams} | self.wake_args(wakes),
                               rest_keys=keys, rest=rest))  # fmt: skip
        if len(calls) == 1:
            return calls[0]
        # A shard's reply is 0 when it refused nothing and saw no fence move.
        return SplitCall(
            calls,
            merge=lambda replies: [
                _concat(r[0] for r in replies if r),
                _concat(r[1] for r in replies if r),
            ],
        )

    @staticmethod
    def step_call(stream: Call, ends: list[Call]) -> ScriptCall | None:
        """A `stream_call` and the `merge_ends` of one moment as one STEP call (one EVALSHA,
        its reply [the STREAM reply, the END replies]), when both are about the same one shard;
        else None (they run as two calls)."""
        if not (isinstance(stream, ScriptCall) and len(ends) == 1):
            return None
        end = ends[0]
        if not isinstance(end, ScriptCall) or hash_tag(stream.keys[0]) != hash_tag(end.keys[0]):
            return None
        n_stream, n_end = len(STREAM.args), len(END.args)
        named = dict(zip(STREAM.args, stream.args[:n_stream], strict=True))
        ending = dict(zip(END.args, end.args[:n_end], strict=True))
        # Either part may be the one that renews a hub's TTL.
        named["wake_ttl"] = max(named["wake_ttl"], ending["wake_ttl"])
        named |= {"counters": ending["counters"], "stream_args": len(stream.args) - n_stream}
        return _call(STEP, args=named, rest_keys=[*stream.keys, *end.keys],
                     rest=[*stream.args[n_stream:], *end.args[n_end:]])  # fmt: skip

    def stream_lost(self, reply: Any) -> list[str]:
        """The job ids a STREAM reply refused (their lease was lost); remembers the lease fences
        it saw move, so that the next calls check leases only when a fence moves again."""
        if not reply:  # 0: nothing refused, no fence moved
            return []
        lost, fences = reply
        for i in range(0, len(fences), 2):
            self._fences[fences[i].decode()] = fences[i + 1].decode()
        return [job_id.decode() for job_id in lost]

    @staticmethod
    def cancel_check(job_ids: list[str]) -> Command | SplitCall:
        """MGET of the cancel keys of `job_ids` (a fallback for missed cancel messages), one
        per shard."""
        groups = _by_shard(job_ids, hash_tag)
        calls = [Command("MGET", [cancel_key(job_ids[i]) for i in ix]) for ix in groups.values()]
        return calls[0] if len(calls) == 1 else SplitCall(calls, _in_order(groups, len(job_ids)))

    # --- leases -------------------------------------------------------------------------------

    def heartbeat_call(self, claims: list[Claim], state: str) -> ScriptCall | SplitCall:
        """Renew every held lease and the worker's registration; reply: members whose lease is
        gone (another worker's reaper took the job). Sharded: a script per shard holding
        leases, and the registration's HSET and EXPIRE beside them."""
        t = time.time()
        args = {
            "lease_deadline": t + self.lease_ttl,
            "worker_ttl": self.worker_ttl,
            "now": t,
            "last_heartbeat": rq_date(t),
            "state": state,
            "counters": int(self.counters),
        }
        groups = _by_shard(claims, lambda c: hash_tag(c.queue))
        if self.counters:
            groups = groups or {"": []}
        calls: list[ScriptCall | Command] = []
        for indexes in groups.values():
            rest: list[Any] = []
            for c in (claims[i] for i in indexes):
                rest += [c.queue, c.member]
            wips = sorted({rq_wip_key(claims[i].queue) for i in indexes})
            calls.append(
                _call(HEARTBEAT, args=args, rest_keys=[*wips, *self._worker_keys()], rest=rest)
            )
        if self.counters:
            return calls[0]
        fields = ["last_heartbeat", args["last_heartbeat"], "pagedq_heartbeat", t, "state", state]
        calls.append(Command("HSET", [self.key, *fields]))
        calls.append(Command("EXPIRE", [self.key, self.worker_ttl]))
        n = len(groups)
        return SplitCall(calls, merge=lambda replies: _concat(replies[:n]))

    def reap_call(self, dead_holder: str | None = None) -> ScriptCall:
        """Requeue (or fail, after max_crashes) jobs whose lease expired, or with `dead_holder`
        every job that worker holds (it is known to be dead); the reply is (requeued ids,
        failed ids)."""
        t = time.time()
        reason = crash_reason(self.max_crashes)
        args = {
            "now": t,
            "until": t if dead_holder is None else "+inf",
            "holder": dead_holder or "",
            "max_crashes": self.max_crashes,
            "ended_at": rq_date(t),
            "failure_ttl": self.result_ttl,
            "exc_string": rq_exc_string(reason),
            "reason": reason,
            "stream_ttl": self.stream_ttl,
            "maxlen": STREAM_MAXLEN,
            "limit": REAP_LIMIT,
            # The hubs of the jobs it ends are not known here: a rare call renews every TTL.
            "wake_minid": str(int(t * 1000) - WAKE_RETAIN_MS),
            "wake_ttl": WAKE_TTL_S,
        }
        by_tag = _by_shard(self.all_queues(), hash_tag)
        queues = self.all_queues()
        calls = [
            _call(REAP, args=args, rest_keys=[rq_wip_key(queues[i]) for i in indexes])
            for indexes in by_tag.values()
        ]
        if len(calls) == 1:
            return calls[0]
        # Reply: (requeued ids, failed ids) of every shard together.
        return SplitCall(calls, merge=lambda replies: [_concat(r[0] for r in replies),
                                                       _concat(r[1] for r in replies)])  # fmt: skip

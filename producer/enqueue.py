"""Enqueue validated requests as RQ jobs, pipelined and idempotent per job id."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import NoScriptError
from rq import Queue, Retry
from rq.job import Job
from rq.utils import now

from producer.contract.ids import job_id_for
from producer.contract.keys import (
    BELL_JOBS,
    GENERATE_FUNC,
    RQ_QUEUES,
    cancel_key,
    result_key,
    rq_job_key,
    rq_queue_key,
    stream_key,
)
from producer.contract.lua import RING_BELL_LUA, LuaScript
from producer.contract.routing import Routing
from producer.contract.schema import GenerationRequest, GenerationResult
from producer.contract.shards import QueueShards, hash_tag, shard_name
from producer.results import job_shell

# RQ's own unique enqueue (Queue.enqueue_job(unique=True)) cannot run inside a pipeline, and
# Queue.enqueue_many has no unique mode; this is RQ's script (rq/scripts.py) for many jobs at
# once, plus a check of our result key, so a job whose RQ hash expired before its result is not
# computed again. Stamps the enqueue time from Redis's clock (one clock for every producer and
# worker, for aging) and the fair-queueing fields, and indexes each sub-queue for the workers'
# fair pick. Per call: one TIME, per queue one LLEN and one RPUSH, and per base queue that got
# jobs one ring of its bell per BELL_JOBS of them (RPUSH, LTRIM, EXPIRE: waiting workers BLPOP
# it, worker/doorbell.py); per job one EXISTS and one HSET. ARGV after the named ones, per job:
# ENQUEUE_FIELDS, then `n_fields` field/values of the job hash. Returns per job 1 created, 0
# existing.
ENQUEUE_FIELDS = ("job_id", "queue_name", "base", "meta", "cost", "tenant", "n_fields")
ENQUEUE_IF_ABSENT = LuaScript(
    "enqueue",
    args=("batch", "notify", "wake"),
    libraries=(RING_BELL_LUA,),
    body=f"""
local t = redis.call('TIME')
local enqueued = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local created, pushes, order, seen, indexed, rings = {{}}, {{}}, {{}}, {{}}, {{}}, {{}}
local i = REST
while i <= #ARGV do
    local job_id, queue_name, base, meta, cost, tenant, n = unpack(ARGV, i, i + 6)
    n = tonumber(n)
    local first = i + {len(ENQUEUE_FIELDS)}
    i = first + n
    local jkey = RQ.job .. job_id
    if redis.call('EXISTS', jkey, K.result .. job_id) > 0 then
        created[#created + 1] = 0
    else
        local qkey = RQ.queue .. queue_name
        if not seen[qkey] then
            seen[qkey] = true
            order[#order + 1] = qkey
            pushes[qkey] = {{}}
            if redis.call('LLEN', qkey) == 0 then
                -- The tenant was idle here: it shares from now on (worker/rq_scripts.py).
                local fair = K.fair .. string.match(base, '^[^@]*')
                local v = tonumber(redis.call('HGET', fair, 'v')) or 0
                local f = tonumber(redis.call('HGET', fair, 'F:' .. tenant)) or v
                redis.call('HSET', fair, 'F:' .. tenant, tostring(math.max(f, v)))
            end
        end
        local fields = {{unpack(ARGV, first, first + n - 1)}}
        for _, kv in ipairs({{F.enqueued, enqueued, F.cost, cost, F.base, base, F.meta, meta}}) do
            fields[#fields + 1] = kv
        end
        if a_batch ~= '' then fields[#fields + 1] = F.batch; fields[#fields + 1] = a_batch end
        if a_notify ~= '' then fields[#fields + 1] = F.notify; fields[#fields + 1] = a_notify end
        if a_wake ~= '' then fields[#fields + 1] = F.wake; fields[#fields + 1] = a_wake end
        redis.call('HSET', jkey, unpack(fields))
        local p = pushes[qkey]
        p[#p + 1] = job_id
        rings[base] = (rings[base] or 0) + 1
        if queue_name ~= base and not indexed[queue_name] then
            indexed[queue_name] = true
            redis.call('HSET', K.subqueues .. base, queue_name, meta)
        end
        created[#created + 1] = 1
    end
end
for _, qkey in ipairs(order) do
    if #pushes[qkey] > 0 then redis.call('RPUSH', qkey, unpack(pushes[qkey])) end
end
for base, n in pairs(rings) do ring_bell(base, math.ceil(n / {BELL_JOBS})) end
return created
""",
)

ENQUEUE_SHA = hashlib.sha1(ENQUEUE_IF_ABSENT.source.encode()).hexdigest()

# A job that ended like this is run again when resubmitted under the same custom_id.
RERUN_STATUSES = {"failed", "canceled", "stopped"}


@dataclass(slots=True)
class QueuedJob:
    """An RQ job ready to be saved, with where it waits."""

    job: Job
    routing: Routing

    @property
    def id(self) -> str:
        """The job id."""
        return self.job.id


def request_job_id(
    request: GenerationRequest,
    queue_name: str,
    id_namespace: str | None = None,
    payload: dict | None = None,
    shards: QueueShards | None = None,
) -> str:
    """The job id `build_job` gives a request (a fresh uuid4 hex when it has no custom_id),
    placed on its shard when `shards` are tagged (producer/contract/shards.py)."""
    key = request.custom_id
    if key is not None and id_namespace is not None:
        key = f"{id_namespace}/{key}"
    plain = job_id_for(key, queue_name, request.payload() if payload is None else payload)
    return plain if shards is None else shards.place(plain)[0]


def build_job(
    queue: Queue,
    request: GenerationRequest,
    *,
    result_ttl: int,
    retries: int,
    job_timeout: int,
    id_namespace: str | None = None,
    shards: QueueShards | None = None,
) -> QueuedJob:
    """The RQ job for one request and its routing, ready to be saved (status queued).

    The job id derives from the custom_id and the request itself (see `job_id_for`), so an
    edited request under an old custom_id is a new job. With `id_namespace` (bulk files:
    custom_ids are unique only within one file) "{id_namespace}/{custom_id}" stands for it.
    A request naming a `model` goes to that model's queue, `{queue}@{canonical model}`, which
    only workers serving the model read; a priority other than 0 or a tenant puts it in a
    sub-queue of that base (producer/contract/routing.py). With tagged `shards`, all of this
    is under the shard the job's id places it on.
    """
    payload = request.payload()
    shards = shards or QueueShards(queue.name)
    plain = request_job_id(request, queue.name, id_namespace, payload)
    job_id, shard = shards.place(plain)
    routing = Routing.of(shard, payload)
    target = queue
    if routing.queue != queue.name:
        target = Queue(routing.queue, connection=queue.connection, serializer=queue.serializer)
    job = target.create_job(
        GENERATE_FUNC,
        args=[payload],
        # RQ allows letters, digits, '_' and '-' in an id: a shard's tag is set past its check.
        job_id=None if shards.sharded else job_id,
        result_ttl=result_ttl,
        failure_ttl=result_ttl,
        timeout=job_timeout,
        retry=Retry(max=retries) if retries > 0 else None,
        description=f"{GENERATE_FUNC}({request.custom_id or job_id})",
    )
    job._id = job_id
    job.enqueued_at = now()
    return QueuedJob(job, routing)


def _hset_args(job: Job) -> list[bytes | str]:
    args: list[bytes | str] = []
    for field, value in job.to_dict().items():
        # RQ writes eight fields empty (started_at, worker_name, callback names, ...) and reads
        # a missing one as empty: left out, they cost the enqueue script nothing.
        if value is not None and value != "":
            args += [field, value if isinstance(value, bytes | str) else str(value)]
    return args


def enqueue_jobs(
    connection: Redis,
    queue: Queue,
    jobs: Sequence[QueuedJob],
    batch_id: str | None = None,
    notify: str | None = None,
    wake: str | None = None,
) -> list[bool]:
    """Save and push each job (to its routing's queue) unless it or its result exists; one
    round trip, one script call per shard. True = created.

    With `batch_id` (a gateway batch), the script that ends each job counts it in
    `batch_counts_key(batch_id)` (with the job's shard tag in front, when sharded); with
    `notify`, it adds the job's end to `events_key(notify)` (likewise) while that stream
    exists (producer/follow.py); with `wake` (a gateway's stream hub), each token entry the
    job's stream gets is listed in `wake_key(wake)` (likewise)."""
    if not jobs:
        return []
    by_shard: dict[str, list[int]] = {}
    for i, queued in enumerate(jobs):
        by_shard.setdefault(hash_tag(queued.routing.queue), []).append(i)
    queue_keys = sorted({rq_queue_key(j.routing.queue) for j in jobs})
    if "" in by_shard:  # not sharded: the queue itself is listed, as it always was
        queue_keys = sorted({rq_queue_key(queue.name), *queue_keys})
    calls = []
    for tag, indexes in by_shard.items():
        rest: list[bytes | str] = []
        for i in indexes:
            r = jobs[i].routing
            fields = _hset_args(jobs[i].job)
            head = {
                "job_id": jobs[i].id,
                "queue_name": r.queue,
                "base": r.base,
                "meta": r.meta,
                "cost": str(r.cost),
                "tenant": r.tenant,
                "n_fields": str(len(fields)),
            }
            rest += [head[name] for name in ENQUEUE_FIELDS] + fields
        keys = sorted({rq_queue_key(jobs[i].routing.queue) for i in indexes})
        extra = {
            "batch": shard_name(tag, batch_id) if batch_id else "",
            "notify": shard_name(tag, notify) if notify else "",
            "wake": shard_name(tag, wake) if wake else "",
        }
        _, args = ENQUEUE_IF_ABSENT.keys_and_args(args=extra, rest=rest)
        calls.append((keys, args))

    def run() -> list:
        pipe = connection.pipeline(transaction=False)
        pipe.sadd(RQ_QUEUES, *queue_keys)
        for keys, args in calls:
            # Not pipe.evalsha: a cluster pipeline refuses that method, not the command.
            pipe.execute_command("EVALSHA", ENQUEUE_SHA, len(keys), *keys, *args)
        return pipe.execute()

    # EVALSHA first, the script loaded only when Redis does not know it (a script object in a
    # pipeline would send SCRIPT EXISTS before every chunk: a second round trip).
    try:
        replies = run()
    except NoScriptError:
        connection.script_load(ENQUEUE_IF_ABSENT.source)
        replies = run()
    created = [False] * len(jobs)
    for (_, indexes), reply in zip(by_shard.items(), replies[1:], strict=True):
        for i, flag in zip(indexes, reply, strict=True):
            created[i] = bool(flag)
    return created


def ended_status(connection: Redis, job_id: str) -> str | None:
    """The RQ status of an existing job, else the status in its result key, else None."""
    status = connection.hget(rq_job_key(job_id), "status")
    if status is not None:
        return status.decode()
    raw = connection.get(result_key(job_id))
    if raw is None:
        return None
    return GenerationResult.model_validate_json(raw).status


def clear_job(connection: Redis, job_id: str) -> None:
    """Delete an ended job and everything pagedq wrote for it, so it can be enqueued afresh."""
    # Not Job.fetch: its default serializer is pickle, and the hash is anyone's to write.
    job = job_shell(connection, job_id)
    if job is not None:
        job.delete(remove_from_queue=True)
    connection.delete(result_key(job_id), stream_key(job_id), cancel_key(job_id))

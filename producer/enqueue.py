"""Enqueue validated requests as RQ jobs, pipelined and idempotent per job id."""

from __future__ import annotations

from collections.abc import Sequence

from redis import Redis
from rq import Queue, Retry
from rq.job import Job
from rq.utils import now

from producer.keys import (
    GENERATE_FUNC,
    cancel_key,
    job_id_for,
    model_queue,
    result_key,
    stream_key,
)
from producer.results import job_shell
from producer.routing import (
    fair_key,
    job_cost,
    subqueue_index_key,
    subqueue_meta,
    subqueue_name,
)
from producer.schema import GenerationRequest, GenerationResult

# RQ's own unique enqueue (Queue.enqueue_job(unique=True)) cannot run inside a pipeline, and
# Queue.enqueue_many has no unique mode; this is RQ's script (rq/scripts.py) plus a check of
# our result key, so a job whose RQ hash expired before its result is not computed again.
# KEYS: job hash, sub-queue list, result key, the base's sub-queue index, its fair accounts.
# ARGV: job id, sub-queue name, base name, index entry (JSON), estimated cost, tenant ("" for
#       none), hash pairs...
# Stamps the enqueue time from Redis's clock (one clock for every producer and worker, for
# aging) and the fair-queueing fields, and indexes the sub-queue for the workers' fair pick.
ENQUEUE_IF_ABSENT = """
if redis.call("EXISTS", KEYS[1]) == 1 or redis.call("EXISTS", KEYS[3]) == 1 then
    return 0
end
local t = redis.call("TIME")
if redis.call("LLEN", KEYS[2]) == 0 then
    -- The tenant was idle here: it shares from now on (see worker/fair_queue.py).
    local v = tonumber(redis.call("HGET", KEYS[5], "v")) or 0
    local f = tonumber(redis.call("HGET", KEYS[5], "F:" .. ARGV[6])) or v
    redis.call("HSET", KEYS[5], "F:" .. ARGV[6], tostring(math.max(f, v)))
end
redis.call("HSET", KEYS[1], unpack(ARGV, 7))
redis.call("HSET", KEYS[1], "pq_enq", t[1] .. "." .. string.format("%06d", tonumber(t[2])),
    "pq_cost", ARGV[5], "pq_base", ARGV[3], "pq_meta", ARGV[4])
redis.call("RPUSH", KEYS[2], ARGV[1])
if ARGV[2] ~= ARGV[3] then redis.call("HSET", KEYS[4], ARGV[2], ARGV[4]) end
return 1
"""

# A job that ended like this is run again when resubmitted under the same custom_id.
RERUN_STATUSES = {"failed", "canceled", "stopped"}


def request_job_id(
    request: GenerationRequest,
    queue_name: str,
    id_namespace: str | None = None,
    payload: dict | None = None,
) -> str:
    """The job id `build_job` gives a request (a fresh uuid4 hex when it has no custom_id)."""
    key = request.custom_id
    if key is not None and id_namespace is not None:
        key = f"{id_namespace}/{key}"
    return job_id_for(key, queue_name, request.payload() if payload is None else payload)


def build_job(
    queue: Queue,
    request: GenerationRequest,
    *,
    result_ttl: int,
    retries: int,
    job_timeout: int,
    id_namespace: str | None = None,
) -> Job:
    """The RQ job for one request, ready to be saved (status queued, enqueued now).

    The job id derives from the custom_id and the request itself (see `job_id_for`), so an
    edited request under an old custom_id is a new job. With `id_namespace` (bulk files:
    custom_ids are unique only within one file) "{id_namespace}/{custom_id}" stands for it.
    A request naming a `model` goes to that model's queue, `{queue}@{canonical model}`, which
    only workers serving the model read (producer.keys.model_queue); a priority other than 0 or
    a tenant puts it in a sub-queue of that base (producer/routing.py).
    """
    payload = request.payload()
    job_id = request_job_id(request, queue.name, id_namespace, payload)
    base = model_queue(queue.name, request.model)
    name = subqueue_name(base, request.priority, request.tenant)
    target = queue
    if name != queue.name:
        target = Queue(name, connection=queue.connection, serializer=queue.serializer)
    job = target.create_job(
        GENERATE_FUNC,
        args=[payload],
        job_id=job_id,
        result_ttl=result_ttl,
        failure_ttl=result_ttl,
        timeout=job_timeout,
        retry=Retry(max=retries) if retries > 0 else None,
        description=f"{GENERATE_FUNC}({request.custom_id or job_id})",
    )
    job.enqueued_at = now()
    return job


def _hset_args(job: Job) -> list[bytes | str]:
    args: list[bytes | str] = []
    for field, value in job.to_dict().items():
        if value is not None:
            args += [field, value if isinstance(value, bytes | str) else str(value)]
    return args


def enqueue_jobs(
    connection: Redis, queue: Queue, jobs: Sequence[Job], batch_id: str | None = None
) -> list[bool]:
    """Save and push each job (to its origin queue: `queue` or a model's queue) unless it or
    its result exists; one round trip. True = created.

    `batch_id` is written to each job hash as `pq_batch`: the script that ends the job counts
    it in `batch_counts_key(batch_id)`."""
    script = connection.register_script(ENQUEUE_IF_ABSENT)
    queue_keys = sorted({queue.key} | {_queue_key(job.origin) for job in jobs})
    pipe = connection.pipeline(transaction=False)
    pipe.sadd(Queue.redis_queues_keys, *queue_keys)
    for job in jobs:
        payload = job.args[0]  # built here from a validated request, never read from Redis
        base = model_queue(queue.name, payload.get("model"))
        priority, tenant = payload.get("priority", 0), payload.get("tenant")
        cost = job_cost(
            payload.get("prompt"),
            sum(len(m.get("content") or "") for m in payload.get("messages") or []),
            payload.get("max_tokens", 256),
            payload.get("n", 1),
        )
        keys = [
            job.key,
            _queue_key(job.origin),
            result_key(job.id),
            subqueue_index_key(base),
            fair_key(base),
        ]
        meta = subqueue_meta(priority, tenant)
        args = [job.id, job.origin, base, meta, cost, tenant or "", *_hset_args(job)]
        if batch_id is not None:
            args += ["pq_batch", batch_id]
        script(keys=keys, args=args, client=pipe)
    return [bool(created) for created in pipe.execute()[1:]]


def _queue_key(name: str) -> str:
    return Queue.redis_queue_namespace_prefix + name


def ended_status(connection: Redis, job_id: str) -> str | None:
    """The RQ status of an existing job, else the status in its result key, else None."""
    status = connection.hget(Job.key_for(job_id), "status")
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

"""Every Redis key, channel and job-hash field pagedq and RQ use, with the TTL defaults.

The only module that spells a key: the producer, the worker, the gateway and the Lua scripts
(through `producer.contract.lua`) take every name from here, and tests/test_contract.py fails
when a key literal appears anywhere else. RQ's own layout (RQ 3.0, prefix ``rq:``) is here
too, so that no other module needs to know it.
"""

from __future__ import annotations

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "PAGEDQ_REDIS_URL"
DEFAULT_QUEUE = "pagedq"
DEFAULT_RESULT_TTL = 7 * 24 * 3600
DEFAULT_STREAM_TTL = 24 * 3600
DEFAULT_CANCEL_TTL = 24 * 3600
STREAM_MAXLEN = 10_000
# Entries an events stream keeps (about 40 bytes each): far more than a producer's window.
EVENTS_MAXLEN = 100_000
# Entries a wake stream keeps (a hub reads them within a read interval), and its TTL, renewed
# by each entry: a hub that went away leaves it for an hour at most.
WAKE_MAXLEN = 1_000
WAKE_TTL_S = 3600
# How long an inline wake stream (one carrying its jobs' entries) keeps them: a hub reads them
# within a read interval; one stalled longer than this has lost its requests anyway.
WAKE_RETAIN_MS = 30_000
# A producer rings a base queue's bell once per this many jobs it enqueued there (a worker
# takes up to 8 a call, worker/engine_loop.py); the bell keeps the last BELL_MAX rings, for an
# hour after the last one.
BELL_JOBS = 8
BELL_MAX = 64
BELL_TTL_S = 3600
# A worker's execution ids (the fencing token of each job it starts) begin with a prefix of
# its own, this many characters long; the reaper finds the worker's lease fence by it.
EXECUTION_PREFIX_CHARS = 12
FENCE_TTL_S = 24 * 3600

GENERATE_FUNC = "pagedq.generate"
"""The only function name a pagedq job may carry; the worker refuses any other."""

# --- pagedq's keys -------------------------------------------------------------------------------
# Prefixes by name: Python builds keys with them, and the Lua scripts get the same table (`K`).
PAGEDQ = {
    "result": "pagedq:result:",  # + job id: the GenerationResult JSON, the one full copy
    # + job id + ":" + execution: a result its worker wrote beside the END that renames it to
    # the result key when that execution still holds the job (the JSON never enters Lua)
    "staged": "pagedq:staged:",
    "stream": "pagedq:stream:",  # + job id: token deltas, then a done/error entry
    "cancel": "pagedq:cancel:",  # + job id: "1" asks workers to cancel the job
    "worker": "pagedq:worker:",  # + worker name: its status JSON (pagedq status/diagnose/top)
    "subqueues": "pagedq:subqueues:",  # + base queue: sub-queue name -> {priority, tenant}
    "fair": "pagedq:fair:",  # + root queue: fair-queueing accounts `v` and `F:{tenant}`
    "fair_weights": "pagedq:fair-weights:",  # + root queue: tenant -> weight
    "tenant_tokens": "pagedq:tenant-tokens:",  # + root queue: tenant -> tokens used
    # + a producer's notify id: a stream of (job_id, status), one entry per ended job that
    # named it; only while its producer keeps it (NOMKSTREAM: workers never create it)
    "events": "pagedq:events:",
    # + a stream hub's wake id: a stream whose entries list the jobs (named it) whose token
    # streams just got entries, so the hub reads only those (gateway/stream_hub.py)
    "wake": "pagedq:wake:",
    # + base queue: a list of rings (a producer pushes one per BELL_JOBS jobs it enqueued
    # there); workers with room BLPOP it instead of polling the queue (worker/doorbell.py)
    "bell": "pagedq:bell:",
    # + queue + ":" + a worker's execution prefix: a counter the reaper bumps when it takes a
    # lease of that worker's jobs in that queue; the worker's STREAM calls compare it with the
    # value they last saw instead of checking each job's lease every window
    "fence": "pagedq:fence:",
    # The gateway's files and batches (gateway/):
    "file": "pagedq:file:",  # + file id: hash of a file's fields
    "file_data": "pagedq:file-data:",  # + file id: list of an uploaded file's chunks
    "files": "pagedq:files:",  # + owner: zset of file ids by creation time (us)
    "batch": "pagedq:batch:",  # + batch id: hash of a batch's fields and progress
    "batch_counts": "pagedq:batch-counts:",  # + batch id: line ends, counted by ending scripts
    "batch_lease": "pagedq:batch-lease:",  # + batch id: the gateway working on it
    "batches": "pagedq:batches:",  # + owner: zset of batch ids by creation time (us)
    "response": "pagedq:response:",  # + response id: a stored Responses object and its turns
}
ACTIVE_BATCHES = "pagedq:active-batches"  # set of batches still needing a gateway's work
CANCEL_CHANNEL = "pagedq:cancel"
WORKER_KEY_PATTERN = PAGEDQ["worker"] + "*"

# --- RQ's keys ---------------------------------------------------------------------------------
RQ = {
    "job": "rq:job:",  # + job id: the job hash
    "queue": "rq:queue:",  # + queue name: the list workers pop
    "wip": "rq:wip:",  # + queue name: the started registry (zset: member -> lease deadline)
    "finished": "rq:finished:",  # + queue name: registries of ended jobs (zset: id -> expiry)
    "failed": "rq:failed:",
    "canceled": "rq:canceled:",
    "results": "rq:results:",  # + job id: RQ's result stream
    "worker": "rq:worker:",  # + worker name: the worker hash `rq info` reads
    "workers_of": "rq:workers:",  # + queue name: set of worker keys
}
RQ_QUEUES = "rq:queues"  # set of every queue key
RQ_WORKERS = "rq:workers"  # set of every worker key
# RQ's Result.Type values, as its result stream stores them.
RQ_RESULT_SUCCESSFUL, RQ_RESULT_FAILED = 1, 2

# --- job-hash fields pagedq adds to RQ's ----------------------------------------------------------
JOB_FIELDS = {
    "execution": "pagedq_execution",  # the holding worker's fencing token
    "attempts": "pagedq_attempts",  # runs started so far
    "crashes": "pagedq_crashes",  # worker crashes the job was in flight during
    "enqueued": "pq_enq",  # enqueue time from Redis's clock (aging)
    "cost": "pq_cost",  # estimated tokens (fair queueing)
    "base": "pq_base",  # the base queue of its sub-queue
    "meta": "pq_meta",  # its sub-queue's index entry (JSON)
    "tenant": "pq_tenant",  # the tenant charged when it ends
    "batch": "pq_batch",  # the gateway batch whose counts its end goes to
    "notify": "pq_notify",  # the events stream (PAGEDQ["events"] + it) its end is told to
    "wake": "pq_wake",  # the wake stream (PAGEDQ["wake"] + it) its token entries are told to
}


def result_key(job_id: str) -> str:
    """Key of the plain JSON GenerationResult of a job."""
    return PAGEDQ["result"] + job_id


def staged_result_key(job_id: str, execution: str) -> str:
    """Key of a result written ahead of its END, which renames it to `result_key` (or drops it
    when `execution` no longer holds the job)."""
    return f"{PAGEDQ['staged']}{job_id}:{execution}"


def stream_key(job_id: str) -> str:
    """Key of the Redis stream carrying a job's token deltas and its final done/error entry."""
    return PAGEDQ["stream"] + job_id


def events_key(notify: str) -> str:
    """Key of a producer's events stream: one (job_id, status) entry per ended job naming it."""
    return PAGEDQ["events"] + notify


def bell_key(base: str) -> str:
    """Key of a base queue's doorbell: a list a producer pushes a ring to per BELL_JOBS jobs it
    enqueued there, which waiting workers BLPOP."""
    return PAGEDQ["bell"] + base


def wake_key(wake: str) -> str:
    """Key of a stream hub's wake stream: entries of space-separated job ids whose token
    streams got entries."""
    return PAGEDQ["wake"] + wake


def fence_key(queue: str, prefix: str) -> str:
    """Key of the lease fence of one worker (its execution prefix) in one queue: bumped by the
    reaper whenever it takes a lease of that worker's jobs there."""
    return PAGEDQ["fence"] + queue + ":" + prefix


def cancel_key(job_id: str) -> str:
    """Key whose presence ("1") asks workers to cancel a job."""
    return PAGEDQ["cancel"] + job_id


def worker_key(name: str) -> str:
    """Key of a worker's status JSON {in_flight, running, waiting, kv_cache_usage, ...}."""
    return PAGEDQ["worker"] + name


def file_key(file_id: str) -> str:
    """Hash of a gateway file's fields."""
    return PAGEDQ["file"] + file_id


def file_data_key(file_id: str) -> str:
    """List of an uploaded file's chunks (whole lines)."""
    return PAGEDQ["file_data"] + file_id


def files_index_key(owner: str) -> str:
    """Sorted set of an owner's file ids, scored by creation time (microseconds)."""
    return PAGEDQ["files"] + owner


def response_key(response_id: str) -> str:
    """A stored Responses API response (`store`): the object, its owner and the conversation
    it ends (for `previous_response_id`), JSON, with a TTL."""
    return PAGEDQ["response"] + response_id


def batch_key(batch_id: str) -> str:
    """Hash of a gateway batch's fields."""
    return PAGEDQ["batch"] + batch_id


def batch_counts_key(batch_id: str) -> str:
    """Hash of a batch's line counts: `finished`, `failed`, `canceled` (+1 as each of its jobs
    ends, in the script that ends it) and `prompt_tokens`, `completion_tokens` of finished ones;
    counted only while the hash exists (the batch's owner creates it)."""
    return PAGEDQ["batch_counts"] + batch_id


def batch_lease_key(batch_id: str) -> str:
    """The lease of the gateway working on a batch."""
    return PAGEDQ["batch_lease"] + batch_id


def batches_index_key(owner: str) -> str:
    """Sorted set of an owner's batch ids, scored by creation time (microseconds)."""
    return PAGEDQ["batches"] + owner


def subqueue_index_key(base: str) -> str:
    """Hash of the sub-queues of ``base``: RQ queue name -> {"priority": p, "tenant": t}."""
    return PAGEDQ["subqueues"] + base


def root_queue(base: str) -> str:
    """The queue a base belongs to: ``pagedq@model`` -> ``pagedq`` (accounts are per root)."""
    return base.split("@", 1)[0]


def fair_key(base: str) -> str:
    """Hash of the fair-queueing accounts of a queue: `v` and one `F:{tenant}` per tenant."""
    return PAGEDQ["fair"] + root_queue(base)


def weights_key(base: str) -> str:
    """Hash of tenant weights of a queue (tenant -> weight; absent = 1), set by workers."""
    return PAGEDQ["fair_weights"] + root_queue(base)


def tenant_tokens_key(base: str) -> str:
    """Hash of tokens used per tenant of a queue (tenant -> count; "" = no tenant)."""
    return PAGEDQ["tenant_tokens"] + root_queue(base)


def rq_job_key(job_id: str) -> str:
    """RQ's hash of a job."""
    return RQ["job"] + job_id


def rq_queue_key(name: str) -> str:
    """RQ's list of a queue."""
    return RQ["queue"] + name


def rq_queue_name(key: str) -> str:
    """The queue name of an RQ queue key."""
    return key.removeprefix(RQ["queue"])


def rq_wip_key(queue: str) -> str:
    """RQ's started registry of a queue (pagedq's leases)."""
    return RQ["wip"] + queue


def rq_registry_key(registry: str, queue: str) -> str:
    """RQ's registry of ended jobs: `registry` is finished, failed or canceled."""
    return RQ[registry] + queue


def rq_results_key(job_id: str) -> str:
    """RQ's result stream of a job."""
    return RQ["results"] + job_id


def rq_worker_key(name: str) -> str:
    """RQ's hash of a worker (what `rq info` lists)."""
    return RQ["worker"] + name


def rq_workers_of_key(queue: str) -> str:
    """RQ's set of the workers serving a queue."""
    return RQ["workers_of"] + queue

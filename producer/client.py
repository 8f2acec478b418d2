"""The pagedq producer client: submit generation jobs to Redis and read their results."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

from redis import Redis, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, OutOfMemoryError, ReadOnlyError
from rq import Queue
from rq.serializers import JSONSerializer

from producer.connection import is_cluster, redis_client
from producer.contract import stream as stream_entry
from producer.contract.keys import (
    CANCEL_CHANNEL,
    DEFAULT_CANCEL_TTL,
    DEFAULT_QUEUE,
    DEFAULT_REDIS_URL,
    DEFAULT_RESULT_TTL,
    DEFAULT_STREAM_TTL,
    JOB_FIELDS,
    STREAM_MAXLEN,
    batch_counts_key,
    cancel_key,
    result_key,
    rq_job_key,
    stream_key,
)
from producer.contract.lua import LuaScript
from producer.contract.schema import GenerationRequest, GenerationResult
from producer.contract.shards import QueueShards
from producer.enqueue import (
    RERUN_STATUSES,
    QueuedJob,
    build_job,
    clear_job,
    ended_status,
    enqueue_jobs,
)
from producer.errors import RedisFullError, ReplicaAckError
from producer.follow import StreamFollower
from producer.replica_ack import ReplicaAckedRedis
from producer.results import (
    final_result,
    is_final,
    job_shell,
    raise_for_status,
    read_job_payload,
    read_result,
)
from producer.retry import DEFAULT_OUTAGE_S, call_with_retry

T = TypeVar("T")
DEFAULT_JOB_TIMEOUT = 3600
DEFAULT_REPLICA_ACK_TIMEOUT_MS = 1000
# A refused or unroutable Redis is reported within seconds, not after the OS's ~2 min.
CONNECT_TIMEOUT_S = 3.0
# The first check of a job that does not stream (its result key), in `result`.
FIRST_CHECK_S = 0.05
QUEUED_STATUSES = {"queued", "deferred", "scheduled", "created", "rate_limited"}
STATUS_NAMES = {
    "queued": "queued",
    "deferred": "queued",
    "scheduled": "queued",
    "created": "queued",
    "rate_limited": "queued",
    "started": "started",
    "finished": "finished",
    "failed": "failed",
    "canceled": "canceled",
    "stopped": "canceled",
}

RequestLike = GenerationRequest | dict[str, Any]
# Counts a queued job canceled here in its batch, as the worker's ending script counts the others;
# only while the batch's counts hash exists.
COUNT_CANCELED = LuaScript(
    "count_canceled",
    keys=("counts",),
    body="""
if redis.call('EXISTS', k_counts) == 0 then return 0 end
return redis.call('HINCRBY', k_counts, 'canceled', 1)
""",
)


class StreamRestart(str):
    """What `Client.stream()` yields when the job re-ran: drop the text read so far."""


RESTART = StreamRestart("")


class Client:
    """Submits jobs to a pagedq queue (RQ 3, JSON serializer) and reads results and streams.

    `redis_url` is any form `producer.connection` takes, redis+sentinel:// and
    redis+cluster:// included. `queue_shards` N > 1 spreads the queue over N hash-tagged
    shards (each job on one by its id; workers must serve as many); on a cluster every shard
    is tagged, one included.
    `retries` is RQ's retry count for a job whose execution fails (e.g. its worker died);
    `result_ttl` keeps the RQ job and its result that many seconds after it ends.
    Enqueues, `result()` and `stream()` wait out a Redis outage or failover of up to
    `outage_timeout` seconds (None: forever), retrying with backoff and logging each attempt,
    instead of raising. With `min_replicas_ack` N > 0, each enqueue round trip ends with
    Redis WAIT N `replica_ack_timeout_ms`, and fewer acknowledgements raise ReplicaAckError.
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        queue: str = DEFAULT_QUEUE,
        result_ttl: int = DEFAULT_RESULT_TTL,
        retries: int = 3,
        job_timeout: int = DEFAULT_JOB_TIMEOUT,
        check_interval: float = 2.0,
        connection: Redis | None = None,
        outage_timeout: float | None = DEFAULT_OUTAGE_S,
        min_replicas_ack: int = 0,
        replica_ack_timeout_ms: int = DEFAULT_REPLICA_ACK_TIMEOUT_MS,
        queue_shards: int = 1,
    ) -> None:
        _check_replica_ack(min_replicas_ack, replica_ack_timeout_ms)
        if connection is None:
            connection = redis_client(redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S)
        self.redis = connection
        # Enqueues go through a client whose pipelines end with WAIT (producer/replica_ack.py).
        self._writer: Redis = connection
        if min_replicas_ack and is_cluster(connection):
            raise ValueError("min_replicas_ack is not available with a redis+cluster:// URL")
        if min_replicas_ack:
            self._writer = ReplicaAckedRedis(connection, min_replicas_ack, replica_ack_timeout_ms)
        self.outage_timeout = outage_timeout
        self.queue = Queue(queue, connection=self.redis, serializer=JSONSerializer)
        self.shards = QueueShards(queue, queue_shards, tagged=is_cluster(connection))
        self.result_ttl = result_ttl
        self.retries = retries
        self.job_timeout = job_timeout
        self.check_interval = check_interval
        self._count_canceled = self.redis.register_script(COUNT_CANCELED.source)

    def submit(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> str:
        """Enqueue one job and return its id; with `custom_id`, resubmitting the same request
        returns the same id (a different request under that custom_id is a new job).

        The job streams its tokens (`stream()` reads them live) unless `stream=False`."""
        fields.setdefault("stream", True)
        if prompt is not None:
            fields["prompt"] = prompt
        if messages is not None:
            fields["messages"] = messages
        return self.submit_many([fields])[0]

    def submit_many(self, requests: Iterable[RequestLike], chunk_size: int = 500) -> list[str]:
        """Enqueue many jobs, one Redis round trip per chunk; returns their ids in order.

        Bulk jobs write their result only (no token entries) unless a request says
        `"stream": True`; `stream()` then yields a job's whole text when it ends.

        Each chunk is validated whole before it is enqueued, so a bad request raises
        InvalidRequestError with nothing of its chunk enqueued (earlier chunks stay queued).
        """
        job_ids: list[str] = []
        it = iter(requests)
        while chunk := list(islice(it, chunk_size)):
            job_ids += self.enqueue([_as_request(r) for r in chunk])
        return job_ids

    def enqueue(self, requests: list[GenerationRequest], **options: str | None) -> list[str]:
        """Enqueue validated requests in one round trip; an existing job is reused, not re-run.
        `options`: those of `enqueue_created`."""
        return [job_id for job_id, _ in self.enqueue_created(requests, **options)]

    def enqueue_created(
        self,
        requests: list[GenerationRequest],
        id_namespace: str | None = None,
        batch_id: str | None = None,
        notify: str | None = None,
        wake: str | None = None,
    ) -> list[tuple[str, bool]]:
        """Enqueue validated requests in one round trip, each job id with True when this call
        created the job (it had neither a job hash nor a result to reuse: an existing job is
        reused, not re-run).

        `id_namespace` scopes custom_ids (job id from "{id_namespace}/{custom_id}"); with
        `batch_id`, each job's end is counted in `batch_counts_key(batch_id)`; with `notify`,
        each job's end is added to that events stream (producer/events.py); with `wake`, each
        write to a job's token stream is listed in that wake stream (gateway/stream_hub.py).
        """
        queued = [
            build_job(
                self.queue,
                r,
                result_ttl=self.result_ttl,
                retries=self.retries,
                job_timeout=self.job_timeout,
                id_namespace=id_namespace,
                shards=self.shards,
            )
            for r in requests
        ]
        try:
            created = self._write(
                lambda: enqueue_jobs(self._writer, self.queue, queued, batch_id, notify, wake),
                f"enqueueing {len(queued)} job(s)",
            )
            for job, was_created in zip(queued, created, strict=True):
                if not was_created:
                    self._write(
                        lambda j=job: self._rerun_if_ended(j, batch_id, notify, wake),
                        f"job {job.id}",
                    )
        except OutOfMemoryError as exc:
            raise RedisFullError(exc) from exc
        except ReplicaAckError as exc:
            ids = [job.id for job in queued]
            raise ReplicaAckError(exc.acked, exc.wanted, exc.timeout_ms, ids) from None
        return [(job.id, was_created) for job, was_created in zip(queued, created, strict=True)]

    def _rerun_if_ended(
        self, job: QueuedJob, batch_id: str | None, notify: str | None, wake: str | None
    ) -> None:
        """Enqueue an existing job afresh if it failed, was canceled or is gone."""
        if ended_status(self.redis, job.id) in RERUN_STATUSES | {None}:
            clear_job(self.redis, job.id)
            enqueue_jobs(self._writer, self.queue, [job], batch_id, notify, wake)

    def _write(self, fn: Callable[[], T], what: str) -> T:
        """An idempotent write, retried like reads across an outage or a failover."""

        def attempt() -> T:
            try:
                return fn()
            except NoScriptError:
                # A new primary's script cache is empty: the pipeline loads the script again.
                return fn()
            except ReadOnlyError as exc:
                # A demoted primary behind a plain URL: reconnect (a sentinel URL's pool
                # already turns this into a ConnectionError and asks the Sentinels again;
                # a cluster client is redirected by MOVED instead).
                if not is_cluster(self.redis):
                    self.redis.connection_pool.disconnect(inuse_connections=False)
                raise RedisConnectionError(f"Redis is read-only (a replica now?): {exc}") from exc

        return call_with_retry(attempt, what, max_wait_s=self.outage_timeout)

    def result(self, job_id: str, timeout: float | None = None) -> GenerationResult:
        """Block until the job ends and return its result (no polling: XREAD on its stream).

        Raises JobFailedError (carrying the job's error), JobCanceledError, JobNotFoundError,
        or TimeoutError after `timeout` seconds.
        """
        result = self._retry(lambda: read_result(self.redis, job_id), f"reading job {job_id}")
        if result is None:
            *_, final = self._entries(job_id, timeout)
            result = self._final_result(job_id, final)
        return raise_for_status(result)

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """Yield the job's text deltas from its first token on, as the worker produces them.

        Ends when the job finishes; raises like `result()` when it fails or is canceled. When
        the stream expired before the result did, the whole text comes as one delta. A job
        re-run after its worker died restarts its stream (an `event=restart` entry): reading
        starts at the last restart, and a restart met after deltas were yielded yields
        `RESTART` (an empty string marker) before the new run's deltas.
        """
        restarts_to_skip = self._count_restarts(job_id)
        seen_tokens = False
        for entry in self._entries(job_id, timeout):
            event = entry.get(stream_entry.EVENT)
            if restarts_to_skip:
                restarts_to_skip -= event == stream_entry.RESTART
                if not is_final(entry):
                    continue
            if is_final(entry):
                result = raise_for_status(self._final_result(job_id, entry))
                if not seen_tokens and result.text:
                    yield result.text
            elif event == stream_entry.RESTART and seen_tokens:
                seen_tokens = False
                yield RESTART
            elif delta := stream_entry.entry_delta(entry):
                seen_tokens = True
                yield delta

    def _count_restarts(self, job_id: str) -> int:
        entries = self.redis.xrange(stream_key(job_id))
        restart = stream_entry.RESTART.encode()
        return sum(fields.get(stream_entry.EVENT.encode()) == restart for _, fields in entries)

    def _entries(self, job_id: str, timeout: float | None) -> Iterator[dict[str, str]]:
        """The job's stream entries, up to and including its (possibly synthetic) final one.

        A job that does not stream writes no entry: its end is found by checking its result,
        first after 50 ms, then at doubling intervals up to `check_interval`; once entries
        come, only after `check_interval` without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = min(FIRST_CHECK_S, self.check_interval)
        follower = StreamFollower(self.redis, [job_id], check_interval=interval, quiet_checks=True)
        while True:
            block_s = 3600.0 if deadline is None else deadline - time.monotonic()
            if block_s <= 0:
                raise TimeoutError(f"job {job_id} did not end within {timeout} s")
            events = self._retry(lambda b=block_s: follower.read(b), f"following job {job_id}")
            # Checks start quick for a job that writes no entry before its end; once entries
            # come, its final entry will too: checks only cover a stream gone quiet.
            grown = self.check_interval if events else follower.check_interval * 2
            follower.check_interval = min(self.check_interval, grown)
            for _, entry in events:
                yield entry
                if is_final(entry):
                    return

    def _retry(self, fn, what: str):
        return call_with_retry(fn, what, max_wait_s=self.outage_timeout)

    def _final_result(self, job_id: str, entry: dict[str, str]) -> GenerationResult:
        read = lambda: final_result(self.redis, job_id, entry)
        return self._retry(read, f"reading job {job_id}")

    def cancel(self, job_id: str) -> bool:
        """Ask for a job's cancellation; True if it was queued or running, False if it had ended.

        A queued job is canceled through RQ at once (with its canceled result written here, as
        no worker will); a running one is aborted by its worker via the cancel key and channel.
        """
        pipe = self.redis.pipeline()
        pipe.hget(rq_job_key(job_id), "status")
        pipe.set(cancel_key(job_id), "1", ex=DEFAULT_CANCEL_TTL)
        if not is_cluster(self.redis):  # a cluster pipeline takes no PUBLISH: sent after it
            pipe.publish(CANCEL_CHANNEL, job_id)
        # The status before the publish: its worker may cancel the job before we look again.
        was_started = pipe.execute()[0] == b"started"
        if is_cluster(self.redis):
            self.redis.publish(CANCEL_CHANNEL, job_id)
        job = job_shell(self.redis, job_id)  # never Job.fetch: nothing stored is deserialized
        if job is None:
            return False
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(job.key)
                    status, batch = pipe.hmget(job.key, "status", JOB_FIELDS["batch"])
                    status = (status or b"").decode()
                    if status not in QUEUED_STATUSES:
                        return status == "started" or was_started
                    pipe.multi()
                    job.cancel(pipeline=pipe)
                    self._write_canceled(pipe, job)
                    if batch is not None:  # ended here, not by a worker's script: count it
                        keys, args = COUNT_CANCELED.keys_and_args(
                            {"counts": batch_counts_key(batch.decode())}
                        )
                        self._count_canceled(keys=keys, args=args, client=pipe)
                    pipe.execute()
                    return True
                except WatchError:
                    continue

    def _write_canceled(self, pipe: Any, job: Any) -> None:
        payload = read_job_payload(self.redis, job.id)
        custom_id, metadata = payload.get("custom_id"), payload.get("metadata")
        result = GenerationResult(
            job_id=job.id,
            custom_id=custom_id if isinstance(custom_id, str) else None,
            status="canceled",
            error="canceled",
            metadata=metadata if isinstance(metadata, dict) else None,
        )
        pipe.set(result_key(job.id), result.model_dump_json(), ex=self.result_ttl)
        pipe.xadd(
            stream_key(job.id),
            {"event": "error", "error": "canceled"},
            maxlen=STREAM_MAXLEN,
            approximate=True,
        )
        pipe.expire(stream_key(job.id), DEFAULT_STREAM_TTL)

    def status(self, job_id: str) -> str:
        """queued, started, finished, failed, canceled, or unknown (never submitted / expired)."""
        status = self.redis.hget(rq_job_key(job_id), "status")
        if status is not None:
            return STATUS_NAMES.get(status.decode(), "unknown")
        result = read_result(self.redis, job_id)
        return result.status if result is not None else "unknown"

    def close(self) -> None:
        """Release the Redis connections."""
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_replica_ack(replicas: int, timeout_ms: int) -> None:
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ValueError(f"min_replicas_ack must be an integer >= 0, got {replicas!r}")
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms < 1:
        # WAIT's 0 means wait forever: an enqueue must not hang on a missing replica.
        raise ValueError(f"replica_ack_timeout_ms must be an integer >= 1, got {timeout_ms!r}")


def _as_request(request: RequestLike) -> GenerationRequest:
    if isinstance(request, GenerationRequest):
        return request
    return GenerationRequest.parse(request)

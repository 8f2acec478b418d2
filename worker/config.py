"""Settings of one worker process: the engine's (`EngineConfig`), the per-job limits
(`JobLimits`) and the worker's own (Redis, TTLs, leases, metrics, logs).

Each setting is declared once, in its dataclass; `pagedq worker`'s flags are generated from
these declarations (worker/cli.py, worker/flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from producer.contract.keys import (
    DEFAULT_QUEUE,
    DEFAULT_REDIS_URL,
    DEFAULT_RESULT_TTL,
    DEFAULT_STREAM_TTL,
    REDIS_URL_ENV,
)
from worker.limits import JobLimits


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(slots=True)
class WorkerConfig:
    """Everything `pagedq worker` needs: `engine` and `limits` are their own declarations."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: JobLimits = field(default_factory=JobLimits)
    redis_url: str = field(
        default=DEFAULT_REDIS_URL,
        metadata=_doc(
            f"the Redis holding the queue, ${REDIS_URL_ENV} when set; rediss:// for TLS, "
            "redis://user:password@host for ACL users (passwords are never logged), "
            "redis+sentinel://host:port[,host:port...]/service[/db] to follow a Sentinel-managed "
            "primary, redis+cluster://host:port[,host:port...] for a Redis Cluster",
            env=REDIS_URL_ENV,
        ),
    )
    queue: str = field(
        default=DEFAULT_QUEUE,
        metadata=_doc("RQ queue name; the worker also serves `{queue}@{model}`"),
    )
    queue_shards: int = field(
        default=1,
        metadata=_doc(
            "shards the queue is split over (hash-tagged `{queue.i}`, so a Redis Cluster "
            "spreads them over its primaries); the same number as the producers'",
            min=1,
        ),
    )
    result_ttl: int = field(
        default=DEFAULT_RESULT_TTL,
        metadata=_doc(
            "seconds a job's result (`pagedq:result:{id}`), RQ job and registry entries are kept",
            min=1,
        ),
    )
    stream_ttl: int = field(
        default=DEFAULT_STREAM_TTL,
        metadata=_doc("seconds a job's token stream is kept", min=1),
    )
    stream_interval: float = field(
        # bench/redis_capacity.py at 30 tokens/s: 0.05 s put 1.9 tokens in an entry, 0.1 s 3.6
        # and 17% less Redis CPU per streamed token, 0.2 s 5.6 and 1% less again.
        default=0.1,
        metadata=_doc(
            "seconds a streamed token may wait to be written: the new tokens of all the jobs "
            "that stream go in one call per window, one entry per job (a job's first token "
            "and its end are written at once); 0: every step writes its tokens",
            min=0,
        ),
    )
    coalesce_window: float = field(
        default=0.1,
        metadata=_doc(
            "seconds the ending of a job that does not stream may wait to be written with "
            "others in one script call, and a dequeue for fewer than 4 jobs may wait for more "
            "room (fewer, larger Redis calls); 0: each at once",
            min=0,
        ),
    )
    bulk_coalesce_window: float = field(
        default=1.0,
        metadata=_doc(
            "the same wait for bulk jobs (`pagedq submit` lines, Batch API lines), whose ends "
            "are read from an events stream or a batch's counts; 0: at once",
            min=0,
        ),
    )
    prefetch: int = field(
        default=-1,
        metadata=_doc(
            "bulk jobs (`pagedq submit` and Batch API lines) a busy worker may claim ahead, to "
            "wait in its engine: taken in calls of at least half as many, and only while as "
            "many stay queued for other workers (fewer, larger Redis calls); -1: a quarter of "
            "the requests running; 0: claim only what the engine can run now",
            min=-1,
        ),
    )
    rq_results: str = field(
        default="plain",
        metadata=_doc(
            "which jobs also get RQ's result stream entry (what RQ's Job.return_value() reads; "
            "about 4.7 KB of Redis memory each): plain, only jobs a plain RQ producer enqueued; "
            "all, every job",
            choices=("plain", "all"),
        ),
    )
    lease_ttl: int = field(
        default=60,
        metadata=_doc(
            "seconds after which a dead worker's jobs are re-run elsewhere (heartbeats renew "
            "leases every lease_ttl / 3 s); a --name held by a live worker is waited for that "
            "long, one whose process died on this host is taken over at once",
            min=1,
        ),
    )
    max_crashes: int = field(
        default=2,
        metadata=_doc(
            "a job in flight during this many worker crashes fails instead of re-running", min=1
        ),
    )
    job_timeout: float = field(
        default=3600.0,
        metadata=_doc(
            "longest wall-clock seconds a job runs (a job's RQ `timeout` may only shorten it); "
            "over it the job fails with error 'timeout'",
            min=0.001,
        ),
    )
    drain_timeout: float = field(
        default=30.0,
        metadata=_doc(
            "on SIGTERM, seconds to finish running jobs before requeueing them (jobs not begun "
            "go back at once)",
            min=0,
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=_doc("port of Prometheus /metrics and /healthz; 0 = off", min=0),
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata=_doc("address /metrics and /healthz bind to (0.0.0.0: all interfaces)"),
    )
    log_format: str = field(
        default="console",
        metadata=_doc(
            "log line format; json: one JSON object per line", choices=("console", "json")
        ),
    )
    log_level: str = field(default="INFO", metadata=_doc("DEBUG, INFO, WARNING or ERROR"))
    allow_eviction: bool = field(
        default=False,
        metadata=_doc(
            "run on a Redis whose maxmemory-policy may evict keys (queued jobs and results "
            "could vanish); without it the worker refuses to start there"
        ),
    )
    name: str | None = field(
        default=None, metadata=_doc("worker name in RQ and `pagedq status` (none: random)")
    )
    burst: bool = field(
        default=False, metadata=_doc("exit once the queue is empty and nothing is in flight")
    )

    @property
    def model(self) -> str:
        """The served model (the engine's `model`)."""
        return self.engine.model

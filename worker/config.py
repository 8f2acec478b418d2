"""Settings of one worker process (engine settings, Redis, TTLs, leases)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RESULT_TTL = 7 * 24 * 3600
DEFAULT_STREAM_TTL = 24 * 3600
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "PAGEDQ_REDIS_URL"


@dataclass(slots=True)
class WorkerConfig:
    """Everything `pagedq worker` needs; the CLI flags map one to one onto these fields."""

    redis_url: str = DEFAULT_REDIS_URL
    queue: str = "pagedq"
    model: str = "smollm2"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str | None = None  # e.g. "512MiB"; None = the engine decides
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    # "priority" orders the jobs a worker holds by their `priority` field (ties by arrival);
    # "fcfs" ignores it.
    scheduling_policy: str = "priority"
    result_ttl: int = DEFAULT_RESULT_TTL
    stream_ttl: int = DEFAULT_STREAM_TTL
    # A job whose execution lease is not renewed for this long is taken as abandoned and
    # re-run elsewhere; heartbeats renew every lease_ttl / 3 seconds.
    lease_ttl: int = 60
    # A job in flight during this many worker crashes (expired leases, engine crashes) fails.
    max_crashes: int = 2
    # Longest wall-clock time a job may run; a job's own RQ `timeout` may only shorten it.
    job_timeout: float = 3600.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    name: str | None = None
    burst: bool = False
    # On SIGTERM, in-flight jobs get this long to finish before they are requeued.
    drain_timeout: float = 30.0

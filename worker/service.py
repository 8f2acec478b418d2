"""Start one worker process: connect, load the engine once, serve the queue."""

from __future__ import annotations

import time

import redis
import structlog

from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics

log = structlog.get_logger("pagedq.worker")


def build_engine(config: WorkerConfig):
    """The LLMEngine of a worker config."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model=config.model,
            device=config.device,
            dtype=config.dtype,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_cache_memory=config.kv_cache_memory,
            enable_prefix_caching=config.enable_prefix_caching,
            max_model_len=config.max_model_len,
            scheduling_policy=config.scheduling_policy,
        )
    )


def run_worker(config: WorkerConfig) -> int:
    """Serve until stopped; 0 on a clean stop, 1 if Redis is unreachable at start."""
    connection = redis.Redis.from_url(config.redis_url)
    try:
        connection.ping()
    except redis.ConnectionError as exc:
        log.error("cannot reach Redis", redis_url=config.redis_url, error=str(exc))
        return 1
    metrics = WorkerMetrics()
    if config.metrics_port:
        metrics.serve(config.metrics_port)
        log.info("metrics served", port=config.metrics_port, path="/metrics")
    t0 = time.monotonic()
    log.info("loading model", model=config.model, device=config.device, dtype=config.dtype)
    engine = build_engine(config)
    log.info("model loaded", model=engine.model_name, seconds=round(time.monotonic() - t0, 1))

    from worker.batch_worker import BatchWorker

    BatchWorker(config, engine, connection, metrics).work(burst=config.burst)
    return 0

"""Start one worker process: connect, load the engine once, serve the queue.

Start-up problems (a malformed Redis URL, wrong credentials, a refused TLS certificate, an
unreachable Redis, a Redis that may evict keys, a busy metrics port, a worker name in use) end
the process with one log line and a non-zero exit code, never a traceback; Redis URLs are
logged with their password redacted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis
import structlog

from producer.connection import is_cluster
from producer.contract.routing import model_queue
from producer.contract.shards import QueueShards
from producer.refusal import refusal
from producer.retry import redact_url
from worker.config import WorkerConfig
from worker.endpoints import MetricsPortInUse, WorkerHealth
from worker.logs import log_engine_ready
from worker.metrics import WorkerMetrics
from worker.redis_link import ScriptRunner, connect, eviction_risk
from worker.rq_adapter import RQAdapter
from worker.rq_scripts import SCRIPTS

log = structlog.get_logger("pagedq.worker")

# Exit codes.
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def build_engine(config: WorkerConfig):
    """The LLMEngine of a worker config, loaded on a thread of its own that then ends.

    libgomp gives every thread that opens an OpenMP region a pool of its own, and once a process
    has more pool threads than CPUs they spin only briefly before sleeping, so each of a step's
    few hundred parallel ops then waits on a futex wake. Loaded on the main thread, the model
    left one pool there besides the engine thread's: the worker kept 0.72-0.81 of the offline
    engine's tokens/s, its norms and SwiGLU at several times their offline time. A loader
    thread's pool goes with it, and the engine thread's is the only one.
    """
    from engine import LLMEngine

    built: dict[str, object] = {}

    def load() -> None:
        try:
            built["engine"] = LLMEngine(config.engine)
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            built["error"] = exc

    loader = threading.Thread(target=load, name="engine-loader", daemon=True)
    loader.start()
    loader.join()
    if "error" in built:
        raise built["error"]
    return built["engine"]


def open_redis(config: WorkerConfig) -> redis.Redis | int:
    """A connection to the worker's Redis that answered PING, or the exit code after logging
    in one line why there is none (a bad URL, no answer, refused credentials or certificate)."""
    url = redact_url(config.redis_url)
    try:
        connection = connect(config.redis_url)
    except ValueError as exc:
        error = str(exc).replace(config.redis_url, url)
        log.error("invalid --redis-url", redis_url=url, error=error)
        return EXIT_USAGE
    except redis.exceptions.RedisClusterException as exc:  # no node answered the slot map
        log.error("cannot reach Redis", redis_url=url, error=str(exc))
        return EXIT_ERROR
    try:
        connection.ping()
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
        refused = refusal(exc)
        if refused is not None:  # a setting to fix, not an outage: no waiting it out
            log.error(refused.message(at=f" at {url}"))
        elif isinstance(exc, redis.ResponseError):
            log.error("Redis refused the connection", redis_url=url, error=str(exc))
        else:
            log.error("cannot reach Redis", redis_url=url, error=str(exc))
        return EXIT_ERROR
    return connection


def run_worker(config: WorkerConfig, connection: redis.Redis | None = None) -> int:
    """Serve until stopped (on `connection`, from `open_redis`, or one opened here); the
    process exit code."""
    if config.engine.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        return _follow(config)
    url = redact_url(config.redis_url)
    if connection is None:
        connection = open_redis(config)
        if isinstance(connection, int):
            return connection
    try:
        return _serve(config, connection, url)
    except redis.RedisError as exc:  # e.g. an ACL that allows PING but not pagedq's scripts
        refused = refusal(exc)
        if refused is None:
            raise
        log.error(refused.message(at=f" at {url}"))
        return EXIT_ERROR


def _follow(config: WorkerConfig) -> int:
    """A rank other than 0 that ``torchrun`` started: it never touches Redis, only runs rank
    0's step plans on its shard until rank 0 stops."""
    from engine.parallel.state import destroy_tensor_parallel

    log.info("following rank 0", rank=os.environ["RANK"], model=config.model)
    engine = build_engine(config)
    engine.follow()
    destroy_tensor_parallel()
    return EXIT_OK


def _serve(config: WorkerConfig, connection: redis.Redis, url: str) -> int:
    """Run the worker on a Redis that answered PING; the process exit code."""
    risk = eviction_risk(connection)
    if risk is not None:
        if not config.allow_eviction:
            log.error("Redis may evict pagedq's keys; not starting", redis_url=url, why=risk)
            return EXIT_ERROR
        log.warning("Redis may evict pagedq's keys (--allow-eviction)", redis_url=url, why=risk)
    # Health and metrics exist before the model loads: /healthz says "starting" meanwhile, and a
    # busy port fails the start in a second, not after the load.
    health = WorkerHealth(config.model)
    metrics = WorkerMetrics(config.model, health_fn=health.report)
    if config.metrics_port:
        try:
            metrics.serve(config.metrics_port, config.metrics_host)
        except OSError as exc:
            log.error(
                "cannot serve metrics",
                host=config.metrics_host,
                port=config.metrics_port,
                error=str(exc) if isinstance(exc, MetricsPortInUse) else exc.strerror or str(exc),
            )
            return EXIT_ERROR
        log.info("metrics served", host=config.metrics_host, port=config.metrics_port)
    try:
        queues = served_queues(config, is_cluster(connection))
    except ValueError as exc:  # a queue name pagedq cannot tag, or a shard count out of range
        log.error("invalid --queue / --queue-shards", error=str(exc))
        return EXIT_USAGE
    adapter = RQAdapter(
        connection,
        config.name or uuid.uuid4().hex,
        queues,
        lease_ttl=config.lease_ttl,
        result_ttl=config.result_ttl,
        stream_ttl=config.stream_ttl,
        max_crashes=config.max_crashes,
        aging_seconds=config.engine.priority_aging_seconds or 0,
        rq_results=config.rq_results,
    )
    try:
        with _stop_before_serving():
            # What the worker needs of Redis, tried before the model loads: an ACL that refuses
            # a key or a command stops the start here, at once.
            claim_name(adapter)
            ScriptRunner(connection).load(SCRIPTS)
            t0 = time.monotonic()
            log.info(
                "loading model",
                model=config.model,
                device=config.engine.device,
                dtype=config.engine.dtype,
            )
            engine = build_engine(config)
    except StoppedBeforeServing as stop:
        # Nothing was claimed yet: no job waits on this worker.
        log.info("stopped before serving", signal=stop.signal_name)
        return 0
    log_engine_ready(engine, time.monotonic() - t0)

    from worker.control_loop import ControlLoop, WorkerNameTaken

    loop = ControlLoop(config, engine, adapter, metrics, health)
    try:
        return loop.run(burst=config.burst)
    except WorkerNameTaken:
        _log_name_taken(adapter.name)
        return EXIT_ERROR
    finally:
        engine.shutdown()  # the other tensor-parallel ranks, if any


class StoppedBeforeServing(Exception):
    """SIGTERM or SIGINT came while the worker was still starting (waiting for its name,
    loading the model)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextmanager
def _stop_before_serving() -> Iterator[None]:
    """A stop signal during the start ends it cleanly (exit 0, one line) instead of killing
    the process mid-load; the control loop installs its own handlers once it serves."""

    def stop(signum: int, frame: object) -> None:
        raise StoppedBeforeServing(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def served_queues(config: WorkerConfig, cluster: bool) -> list[str]:
    """The base queues the worker serves: per shard its model's queue, then the generic one."""
    shards = QueueShards(config.queue, config.queue_shards, tagged=cluster)
    return [q for shard in shards.names for q in (model_queue(shard, config.model), shard)]


def claim_name(adapter: RQAdapter) -> None:
    """Make the worker's name free to register: taken over at once from a predecessor that
    provably died (same host, its PID gone: a crashed process or pod restarted under its stable
    name), whose jobs are requeued now instead of when their leases run out; else, while a live
    worker holds it, wait for that worker's lease to run out."""
    if not adapter.name_in_use():
        return
    if adapter.predecessor_gone():
        requeued, failed = ScriptRunner(adapter.connection).call(
            adapter.reap_call(dead_holder=adapter.name)
        )
        adapter.unregister()
        log.warning(
            "took over the name of a dead worker on this host",
            worker=adapter.name,
            requeued=[j.decode() for j in requeued],
            failed=[j.decode() for j in failed],
        )
        return
    log.warning(
        "a live worker has this name (its heartbeat is younger than --lease-ttl): waiting "
        "for its lease to run out",
        worker=adapter.name,
        lease_ttl=adapter.lease_ttl,
    )
    while adapter.name_in_use():
        time.sleep(min(1.0, adapter.lease_ttl / 4))
    log.info("the name is free", worker=adapter.name)


def _log_name_taken(name: str) -> None:
    log.error(
        "a live worker already has this name (its heartbeat is younger than --lease-ttl)",
        worker=name,
    )

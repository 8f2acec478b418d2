"""The RQ batch worker: many jobs in flight in one engine batch, each ended through RQ itself.

All RQ and Redis calls run on the control thread (the thread that calls `work()`); the engine
steps on its own thread (`EngineLoop`). Jobs are dequeued only while the engine can admit one
more request, and each is marked started (execution + started registry) as it is dequeued.
"""

from __future__ import annotations

import queue as queue_mod
import signal
import time
from typing import Any

import redis
import structlog
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import BaseWorker, WorkerStatus

from producer.schema import (
    CANCEL_CHANNEL,
    GenerationRequest,
    cancel_key,
    stream_key,
    worker_key,
)
from worker.config import WorkerConfig
from worker.engine_loop import AddFailed, AddRequest, EngineCrashed, EngineLoop, StepOutputs
from worker.inflight import InFlight
from worker.job_endings import JobEndingsMixin
from worker.jobs import JobRejected, parse_job, sampling_kwargs
from worker.leases import LeasesMixin
from worker.metrics import WorkerMetrics
from worker.streams import StreamState, xadd

log = structlog.get_logger("pagedq.worker")

# How long the control loop waits for engine events when there is nothing else to do.
EVENT_WAIT_S = 0.02
# After an empty non-blocking dequeue with jobs in flight, wait this long before asking again.
EMPTY_QUEUE_BACKOFF_S = 0.1
# An idle worker blocks on the queue this long per call (BLMOVE), so signals are seen soon.
IDLE_DEQUEUE_TIMEOUT_S = 1
CANCEL_POLL_S = 1.0
# A queue entry whose job is in one of these states is stale (or a duplicate): never run it.
NOT_RUNNABLE = {
    JobStatus.STARTED,
    JobStatus.FINISHED,
    JobStatus.FAILED,
    JobStatus.CANCELED,
    JobStatus.STOPPED,
}
# Longest time the engine waits between two steps while jobs are being admitted.
ADMISSION_BURST_S = 0.05


class BatchWorker(JobEndingsMixin, LeasesMixin, BaseWorker):
    """An RQ 3 worker that runs every job of one queue through a continuously batching engine."""

    def __init__(
        self,
        config: WorkerConfig,
        engine: Any,
        connection: redis.Redis,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        super().__init__(
            [config.queue],
            name=config.name,
            connection=connection,
            serializer=JSONSerializer,
            default_result_ttl=config.result_ttl,
            job_monitoring_interval=max(1, config.lease_ttl // 3),
            log_job_description=False,
        )
        self.config = config
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.metrics = metrics or WorkerMetrics()
        self.in_flight: dict[str, InFlight] = {}
        self._cancels: queue_mod.SimpleQueue[str] = queue_mod.SimpleQueue()
        self._next_dequeue_at = 0.0
        self._next_heartbeat_at = 0.0
        self._next_reap_at = 0.0
        self._next_cancel_poll_at = 0.0
        self._stop_at: float | None = None
        self._force_stop = False
        self._queue_empty = False
        self.num_ended = 0

    # --- RQ hooks -----------------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Every execution holds a lease of lease_ttl seconds, renewed by each heartbeat."""
        return self.config.lease_ttl

    def subscribe(self) -> None:
        """Listen for RQ worker commands and for pagedq cancels on one pub/sub connection."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(
            **{
                self.pubsub_channel_name: self.handle_payload,
                CANCEL_CHANNEL: self._on_cancel_message,
            }
        )
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=1, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    def request_stop_execution(self, execution_id: str) -> None:
        """RQ's `stop-execution` command (pub/sub thread): cancel that job on the control thread."""
        for job_id, item in list(self.in_flight.items()):
            if item.execution.id == execution_id:
                self._cancels.put(job_id)

    def _install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGTERM, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        if self._stop_at is None:
            # Warm stop: take no new jobs; in-flight ones get drain_timeout to finish.
            self._stop_requested = True
            self.loop.wait_for_admission = False
            self.loop.admitted()
            self._stop_at = time.monotonic() + self.config.drain_timeout
        else:
            self._force_stop = True

    def _on_cancel_message(self, message: dict) -> None:
        data = message.get("data")
        self._cancels.put(data.decode() if isinstance(data, bytes) else str(data))

    # --- main loop ----------------------------------------------------------------------------

    def work(self, burst: bool = False, **kwargs: Any) -> bool:
        """Run until stopped (or, with burst, until the queue is empty and nothing is in flight)."""
        self.register_birth()
        self.subscribe()
        self.set_state(WorkerStatus.IDLE)
        self._install_signal_handlers()
        self.loop.start()
        log.info(
            "worker started",
            worker=self.name,
            queue=self.config.queue,
            model=self.engine.model_name,
        )
        try:
            while True:
                if self._stop_requested and self._should_exit_on_stop():
                    break
                if not self._stop_requested:
                    self._admit()
                if self._handle_events(EVENT_WAIT_S if self.in_flight else 0) is False:
                    break
                self._handle_cancels()
                self._maintain()
                if burst and self._queue_empty and not self.in_flight:
                    log.info("burst done: queue empty, nothing in flight", worker=self.name)
                    break
        finally:
            self._requeue_all("worker stopping")
            self.loop.stop()
            self.connection.delete(worker_key(self.name))
            self.teardown()
            log.info("worker stopped", worker=self.name, jobs_ended=self.num_ended)
        return self.num_ended > 0

    def _should_exit_on_stop(self) -> bool:
        if not self.in_flight:
            return True
        if self._force_stop or (self._stop_at is not None and time.monotonic() > self._stop_at):
            log.warning("stop: requeueing unfinished jobs", count=len(self.in_flight))
            return True
        return False

    def _maintain(self) -> None:
        t = time.monotonic()
        if t >= self._next_heartbeat_at:
            self._heartbeat_all()
            self._next_heartbeat_at = t + max(0.5, self.config.lease_ttl / 3)
        if t >= self._next_reap_at:
            self._reap_expired_leases()
            self._next_reap_at = t + max(1.0, self.config.lease_ttl / 2)
        if t >= self._next_cancel_poll_at and self.in_flight:
            self._poll_cancel_keys()
            self._next_cancel_poll_at = t + CANCEL_POLL_S
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()

    # --- admission ----------------------------------------------------------------------------

    def _admit(self) -> None:
        """Take jobs while the engine can admit them, all between two engine steps."""
        try:
            if time.monotonic() < self._next_dequeue_at:
                return
            with self.loop.paused():
                # Idle, the engine has nothing to step: block on the queue for the first job.
                if not self.in_flight and self.loop.can_admit():
                    if not self._start_next(IDLE_DEQUEUE_TIMEOUT_S):
                        return
                deadline = time.monotonic() + ADMISSION_BURST_S
                while time.monotonic() < deadline and self.loop.can_admit():
                    if not self._start_next(None):
                        return
        finally:
            self.loop.wait_for_admission = not self._queue_empty and not self._stop_requested
            self.loop.admitted()

    def _start_next(self, timeout: int | None) -> bool:
        """Dequeue one job and start it; False when the queue was empty."""
        result = self._dequeue(timeout)
        if result is None:
            self._queue_empty = True
            backoff = EMPTY_QUEUE_BACKOFF_S if self.in_flight else 0
            self._next_dequeue_at = time.monotonic() + backoff
            return False
        self._queue_empty = False
        self._start(*result)
        return True

    def _dequeue(self, timeout: int | None) -> tuple[Job, Queue] | None:
        try:
            return self.queue_class.dequeue_any(
                self._ordered_queues,
                timeout,
                connection=self.connection,
                job_class=self.job_class,
                serializer=self.serializer,
            )
        except DequeueTimeout:
            return None

    def _start(self, job: Job, queue: Queue) -> None:
        """Mark a dequeued job started at once, then validate it and hand it to the engine."""
        if job.get_status(refresh=False) in NOT_RUNNABLE:
            # A stale or duplicate queue entry (e.g. a job canceled or already re-run): skip it.
            self.connection.lrem(queue.intermediate_queue_key, 1, job.id)
            log.info("skipped job not in queued state", job_id=job.id, status=job.get_status(False))
            return
        ttl = self.get_heartbeat_ttl(job)
        with self.connection.pipeline() as pipe:
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.persist(job.key)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            pipe.exists(cancel_key(job.id))
            pipe.xrange(stream_key(job.id))
            *_, canceled, prior_entries = pipe.execute()
        self.executions[execution.id] = execution
        enqueued_at = job.enqueued_at.timestamp() if job.enqueued_at else time.time()
        try:
            request = parse_job(job, self.engine.model_name)
        except JobRejected as exc:
            self._fail_unstarted(job, queue, execution, str(exc))
            return
        item = InFlight(
            job=job,
            queue=queue,
            execution=execution,
            request=request,
            stream=StreamState.from_entries(prior_entries),
            enqueued_at=enqueued_at,
            started_at=time.time(),
        )
        self.in_flight[job.id] = item
        if canceled:
            self._cancel(job.id)
            return
        try:
            params = self._sampling_params(request)
            prompt = request.prompt
            if prompt is None:
                messages = [m.model_dump() for m in request.messages or []]
                prompt = self.engine.apply_chat_template(messages)
        except ValueError as exc:
            self._fail(item, f"invalid request: {exc}")
            return
        self.loop.add(AddRequest(job.id, prompt, params, request.priority))
        log.debug("job started", job_id=job.id, in_flight=len(self.in_flight))

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from engine import SamplingParams

        return SamplingParams(**sampling_kwargs(request))

    # --- engine events ------------------------------------------------------------------------

    def _handle_events(self, wait: float) -> bool:
        """Drain engine events; False when the engine crashed and the worker must exit."""
        events = []
        try:
            events.append(
                self.loop.events.get(timeout=wait) if wait else self.loop.events.get_nowait()
            )
            while True:
                events.append(self.loop.events.get_nowait())
        except queue_mod.Empty:
            pass
        for event in events:
            if isinstance(event, StepOutputs):
                self._on_step(event)
            elif isinstance(event, AddFailed):
                item = self.in_flight.get(event.request_id)
                if item is not None:
                    self._fail(item, f"invalid request: {event.error}")
            elif isinstance(event, EngineCrashed):
                log.error("engine crashed", error=event.error)
                self._requeue_all(f"engine crashed: {event.error}")
                return False
        return True

    def _on_step(self, event: StepOutputs) -> None:
        finished = []
        with self.connection.pipeline(transaction=False) as pipe:
            for output in event.outputs:
                item = self.in_flight.get(output.request_id)
                if item is None:
                    continue  # canceled or requeued meanwhile
                item.last_output = output
                entry = item.stream.token_entry(output.outputs[0])
                if entry is not None:
                    xadd(pipe, stream_key(item.job.id), entry, self.config.stream_ttl)
                self._observe_tokens(item, output, event.time)
                if output.finished:
                    finished.append((item, output))
            pipe.execute()
        log.debug("step", outputs=len(event.outputs), finished=len(finished))
        if not finished:
            return
        # RQ first, then the result key and the done entry: whoever sees those sees RQ agree.
        results = []
        for item, output in finished:
            results.append(self._result(item, output, "finished"))
            self._succeed(item, output, results[-1])
        with self.connection.pipeline(transaction=False) as pipe:
            for (item, output), result in zip(finished, results, strict=True):
                done = {"event": "done", "finish_reason": str(output.outputs[0].finish_reason)}
                self._publish(pipe, item.job.id, result, done)
            pipe.execute()

    def _observe_tokens(self, item: InFlight, output: Any, t: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        num_new, item.num_tokens_seen = num_tokens - item.num_tokens_seen, num_tokens
        if item.first_token_at is None and output.outputs[0].token_ids:
            item.first_token_at = t
            self.metrics.ttft.observe(t - item.started_at)
            since = None
        else:
            since = t - item.last_token_at if item.last_token_at else None
        self.metrics.observe_tokens(max(0, num_new), since)
        item.last_token_at = t

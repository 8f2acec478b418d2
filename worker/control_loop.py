"""The worker's control loop: many jobs in flight in one engine batch, RQ state via fenced scripts.

A job's life through this file: `_admit` takes it (worker/claim.py) while the engine can admit
one more request, `_start` hands its request to the engine thread (worker/engine_loop.py),
`_on_step` streams its tokens (one STREAM call per `--stream-interval` window for all
the jobs that stream, a job's first token at once), and every ending goes through `JobEnder`
(worker/endings.py).
All Redis calls run on this control thread; the engine steps on its own. Every write that ends
or streams a job is fenced, so a worker that lost a lease (frozen, cut off) writes nothing for
it. While Redis is unreachable the engine keeps stepping and the writes wait in `RedisLink`.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import signal
import time
from typing import Any

import structlog

from producer.connection import is_cluster
from producer.contract.models import canonical_model
from producer.refusal import RedisRefusedError
from worker.cancels import CancelListener
from worker.chat import chat_prompt, chat_sampling
from worker.claim import Claim, JobRejected, parse_claim
from worker.coalesce import AdmissionGate, EndCoalescer, StreamWindow
from worker.config import WorkerConfig
from worker.doorbell import SAFETY_POLL_S, Doorbell
from worker.endings import Ending, JobEnder, StepWrite, step_write
from worker.endpoints import WorkerHealth
from worker.engine_loop import (
    AddFailed,
    AddRequest,
    EngineCrashed,
    EngineLoop,
    RequestFailed,
    StepOutputs,
)
from worker.inflight import InFlight, StreamState, stream_entries, window_entries
from worker.leases import Leases
from worker.metrics import WorkerMetrics
from worker.redis_link import (
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    UNAVAILABLE,
    RedisLink,
    raise_if_refused,
)
from worker.rq_adapter import RQAdapter
from worker.status import StatusPublisher
from worker.template_formats import template_formats

log = structlog.get_logger("pagedq.worker")

# How long the control loop waits for engine events when jobs are in flight. Every step's
# outputs wake it at once; a shorter wait only woke it (on a core the engine's threads use) to
# find nothing: 0.02 s gave 0.89-0.92 of offline in bench/service.py, 0.1 s gave 0.92-0.94.
EVENT_WAIT_S = 0.1
# With jobs in flight and the queue empty, ask the queue again after this long (without a
# doorbell, worker/doorbell.py: Redis Cluster).
EMPTY_QUEUE_BACKOFF_S = 0.1
# An idle worker polls the queue, backing off from the first to the second value (without a
# doorbell); with one, it waits for a ring at most the second value at a time.
IDLE_POLL_S = (0.01, 0.25)
# The fallback for cancel messages lost while the pub/sub connection was down (rare).
CANCEL_POLL_S = 5.0
# Longest time the engine waits between two steps while jobs are being admitted.
ADMISSION_BURST_S = 0.05
# After a dequeue that claimed nothing ahead (the queue was not deep enough, or its next job
# is not bulk), try again after this long.
AHEAD_BACKOFF_S = 0.5
# Set only by tests: seconds to sleep right after the dequeue script (to kill the worker there).
SLEEP_AFTER_DEQUEUE_ENV = "PAGEDQ_TEST_SLEEP_AFTER_DEQUEUE"


class WorkerNameTaken(Exception):
    """Another live worker is registered under this name."""


class ControlLoop:
    """Runs a worker: admission, engine events, endings, leases, cancels, Redis outages."""

    def __init__(
        self,
        config: WorkerConfig,
        engine: Any,
        adapter: RQAdapter,
        metrics: WorkerMetrics | None = None,
        health: WorkerHealth | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.model = canonical_model(config.model)
        self.adapter = adapter
        self.link = RedisLink(adapter.connection)
        self.metrics = metrics or WorkerMetrics(engine.model_name)
        self.health = health or WorkerHealth(engine.model_name)
        self.loop = EngineLoop(engine, on_step=self.metrics.observe_step)
        self.formats = template_formats(engine.prompts.tokenizer)
        self.metrics.attach(lambda: self.loop.stats, lambda: len(self.in_flight))
        self.health.attach(self.loop.is_alive, lambda: self.loop.last_step_at)
        self.status = StatusPublisher(
            adapter.connection,
            adapter.name,
            self._config_summary(),
            lambda: self.loop.stats,
            lambda: self.in_flight,
            health=self.health,
        )
        self.ender = JobEnder(
            adapter,
            self.link,
            engine.model_name,
            self.metrics,
            engine.prompts.copy().tokenizer,
            self.formats.summary(),
        )
        self.leases = Leases(config.lease_ttl)
        self.cancels = CancelListener(adapter.connection)
        bell = None if is_cluster(adapter.connection) else adapter.connection
        self.bell = Doorbell(bell, adapter.bell_keys())
        self.in_flight: dict[str, InFlight] = {}
        self.endings: EndCoalescer[Ending] = EndCoalescer(config.coalesce_window)
        self.gate = AdmissionGate(config.coalesce_window)
        self.window = StreamWindow(config.stream_interval)
        self.exit_code = 0
        self._stopping = False
        self._stop_at: float | None = None
        self._force_stop = False
        self._queue_empty = False
        self._next_dequeue_at = 0.0
        self._next_ahead_at = 0.0
        self._handed_back = False
        self._idle_poll_s = IDLE_POLL_S[0]
        self._next_cancel_poll_at = 0.0
        self._test_sleep = float(os.environ.get(SLEEP_AFTER_DEQUEUE_ENV) or 0)

    @property
    def name(self) -> str:
        """The worker's name in RQ (`rq:worker:{name}`) and in pagedq:worker:{name}."""
        return self.adapter.name

    # --- lifecycle ----------------------------------------------------------------------------

    def run(self, burst: bool = False) -> int:
        """Serve until stopped (or, with burst, until the queue is empty and nothing is in
        flight); returns the process exit code (1 after an engine crash)."""
        if not self._register():
            raise WorkerNameTaken(self.name)
        self.cancels.start()
        self.bell.start()
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        self.loop.start()
        log.info("worker started", worker=self.name, queues=self.adapter.queues, model=self.model)
        try:
            while True:
                if self._stopping and not self._handed_back:
                    self._hand_back_not_begun()
                if self._stopping and self._should_exit():
                    break
                if not self.link.up and self.link.poll():
                    self.leases.now()
                if self.link.up and not self._stopping:
                    self._admit()
                if not self._handle_events(self._event_wait() if self.in_flight else 0):
                    break
                if self.window.due(time.monotonic()) and (
                    entries := window_entries(self.window.take(), self.in_flight)
                ):
                    self._write_ends([], entries)
                if self.endings.due(time.monotonic()):
                    self._write_ends([])
                self._handle_cancels()
                self._enforce_timeouts()
                self._maintain()
                self._publish_status()
                if not self.in_flight and not self._stopping and self._queue_empty:
                    t = time.monotonic()
                    ends_in = self.endings.wait_s(t)
                    wait = IDLE_POLL_S[1] if self.bell.enabled else self._idle_poll_s
                    if ends_in is not None:
                        wait = min(wait, ends_in)
                    # A ring (a producer enqueued) ends the wait at once.
                    self.bell.rang.wait(min(wait, max(0.0, self._next_dequeue_at - t)))
                if (
                    burst
                    and self._queue_empty
                    and not self.in_flight
                    and not self.endings.pending
                    and not self.link.outbox
                ):
                    log.info("burst done: queue empty, nothing in flight", worker=self.name)
                    break
        finally:
            # Redis refusing this worker (credentials, ACL) takes nothing more: leases expire.
            with contextlib.suppress(RedisRefusedError):
                if self.endings.pending:
                    self._write_ends([])
                self._requeue_all("worker stopping", count_crash=False)
            self.loop.stop()
            self.cancels.stop()
            self.bell.stop()
            with contextlib.suppress(RedisRefusedError):
                if self.link.up:
                    self.status.clear()
                self._unregister()
            log.info("worker stopped", worker=self.name, jobs_ended=self.ender.num_ended)
        return self.exit_code

    def _config_summary(self) -> dict[str, Any]:
        """The settings `pagedq diagnose` may advise changing, published with the status."""
        engine = self.config.engine
        return {
            "model": self.engine.model_name,
            "queue": self.config.queue,
            "queues": self.adapter.queues,
            "max_num_seqs": engine.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "kv_cache_memory": engine.kv_cache_memory,
            "swap_space": engine.swap_space,
            "scheduling_policy": engine.scheduling_policy,
            "tenant_weights": engine.tenant_weights,
            **self.formats.summary(),
        }

    def _register(self) -> bool:
        """Register with RQ (and publish tenant weights), waiting while Redis is unreachable."""
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                self.adapter.set_tenant_weights(self.config.engine.tenant_weights)
                return bool(self.link.scripts.call(self.adapter.register_call()))
            except UNAVAILABLE as exc:
                raise_if_refused(exc)
                log.warning("redis unreachable, retrying", retry_in_s=backoff, error=str(exc))
                time.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        if self._stop_at is None:
            # Warm stop: take no new jobs; in-flight ones get drain_timeout to finish.
            self._stopping = True
            self.loop.wait_for_admission = False
            self.loop.admitted()
            self._stop_at = time.monotonic() + self.config.drain_timeout
        else:
            self._force_stop = True

    def _hand_back_not_begun(self) -> None:
        """On a warm stop, the jobs the engine has not begun (claimed ahead, or just admitted)
        go back to the front of their queues at once, for other workers: only the ones that
        run get the drain timeout."""
        self._handed_back = True
        job_ids = [
            job_id
            for job_id in self.loop.not_begun()
            if (item := self.in_flight.get(job_id)) is not None and item.first_token_at is None
        ]
        if job_ids:
            self._requeue(job_ids, "worker stopping", count_crash=False)
            log.info("stop: jobs not begun handed back", count=len(job_ids))

    def _should_exit(self) -> bool:
        if not self.in_flight:
            return True  # waiting endings are written on the way out
        if self._force_stop or (self._stop_at is not None and time.monotonic() > self._stop_at):
            log.warning("stop: requeueing unfinished jobs", count=len(self.in_flight))
            return True
        return False

    def _unregister(self) -> None:
        if not self.link.up:
            self.link.poll()
        self.link.flush()
        self.link.attempt(self.adapter.unregister)

    # --- admission ----------------------------------------------------------------------------

    def _admit(self) -> None:
        """Take jobs while the engine can admit them, all between two engine steps."""
        now = time.monotonic()
        if now < self._next_dequeue_at and not self.bell.rang.is_set():
            return
        room, ahead, prefetch = self.loop.admission(self.config.prefetch)
        if not self.gate.ready(room, len(self.in_flight), now):
            # Busy: claim bulk jobs ahead once half the prefetch is missing (see --prefetch).
            if not (ahead and ahead >= (prefetch + 1) // 2 and now >= self._next_ahead_at):
                self.loop.admitted()  # the engine steps on; the room is claimed a little later
                return
            room = 0
        self.gate.dequeued()
        self.bell.rang.clear()
        try:
            with self.loop.paused():
                deadline = time.monotonic() + ADMISSION_BURST_S
                while True:
                    call, started_at = self.adapter.dequeue_call(room, ahead)
                    ok, reply = self.link.attempt(lambda c=call: self.link.scripts.call(c))
                    claims = self.adapter.claims(reply, started_at) if ok else []
                    if len(claims) <= room and ahead:
                        self._next_ahead_at = time.monotonic() + AHEAD_BACKOFF_S
                    if not claims:
                        if room:
                            self._on_empty_queue(ok)
                        return
                    self._queue_empty = False
                    self._idle_poll_s = IDLE_POLL_S[0]
                    # The queue has jobs: the next admission (a claim ahead once the engine is
                    # full) need not wait out the safety poll of the empty queue's wait.
                    self._next_dequeue_at = 0.0
                    self.bell.want(False)
                    if self._test_sleep:
                        time.sleep(self._test_sleep)
                    for claim in claims:
                        self._start_safely(claim)
                    if time.monotonic() >= deadline or not room:
                        break
                    room, ahead, _ = self.loop.admission(self.config.prefetch)
                    if not room:
                        break
        finally:
            self.loop.wait_for_admission = not self._queue_empty and not self._stopping
            self.loop.admitted()

    def _start_safely(self, claim: Claim) -> None:
        try:
            self._start(claim)
        except Exception as exc:  # noqa: BLE001 - one bad job must not stop the loop
            log.exception("job could not start", job_id=claim.job_id)
            if self.in_flight.pop(claim.job_id, None) is not None:
                self.loop.abort(claim.job_id)
            self.ender.fail_claim(claim, f"invalid job: {type(exc).__name__}: {exc}")

    def _on_empty_queue(self, reachable: bool) -> None:
        self._queue_empty = True
        if self.bell.enabled and reachable:
            # Wait for a ring; ask again anyway after SAFETY_POLL_S (jobs nobody rang for).
            self.bell.want(True)
            self._next_dequeue_at = time.monotonic() + SAFETY_POLL_S
            return
        if self.in_flight:
            backoff = EMPTY_QUEUE_BACKOFF_S
        else:
            backoff = self._idle_poll_s
            self._idle_poll_s = min(IDLE_POLL_S[1], self._idle_poll_s * 2)
        self._next_dequeue_at = time.monotonic() + (backoff if reachable else 0)

    def _start(self, claim: Claim) -> None:
        """Validate a claimed job and hand it to the engine; a bad one fails alone."""
        old = self.in_flight.pop(claim.job_id, None)
        if old is not None:  # re-run of a job whose lease we lost: the old run is void
            self.loop.abort(old.job_id)
        try:
            enqueued_at = claim.enqueued_time()
            request = parse_claim(claim, self.engine.model_name, self.config.limits)
        except JobRejected as exc:
            self.ender.fail_claim(claim, str(exc))
            return
        except ValueError as exc:
            self.ender.fail_claim(claim, f"invalid job: {exc}")
            return
        timeout_s = claim.timeout_s(self.config.job_timeout)
        item = InFlight(
            claim=claim,
            request=request,
            stream=StreamState.for_attempt(claim.attempt, request.stream),
            enqueued_at=enqueued_at,
            started_at=claim.started_at,
            deadline=time.monotonic() + timeout_s,
        )
        self.in_flight[claim.job_id] = item
        if claim.canceled:
            self._cancel(claim.job_id)
            return
        from engine import PoolingParams, SamplingParams

        if request.task == "embed":
            params = PoolingParams(dimensions=request.dimensions)
            self.loop.add(
                AddRequest(claim.job_id, request.input, params, request.priority, request.tenant)
            )
            return
        try:
            kwargs = request.sampling_kwargs(self.config.limits.max_tokens)
            params = SamplingParams(**chat_sampling(kwargs, request, self.formats))
        except ValueError as exc:
            self._fail(item, f"invalid request: {exc}")
            return
        # Chat templating and tokenizing run on the engine loop's tokenizer thread.
        prompt = request.prompt if request.prompt is not None else chat_prompt(request)
        self.loop.add(AddRequest(claim.job_id, prompt, params, request.priority, request.tenant))
        log.debug("job started", job_id=claim.job_id, attempt=claim.attempt)

    # --- engine events ------------------------------------------------------------------------

    def _event_wait(self) -> float:
        """How long to wait for engine events: until the stream window is due, at most."""
        due_in = self.window.wait_s(time.monotonic())
        return EVENT_WAIT_S if due_in is None else min(EVENT_WAIT_S, due_in)

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
            elif isinstance(event, RequestFailed):
                # Step isolation found this job to make the engine raise: it would fail the
                # same way on any worker, so it fails now, without a retry.
                item = self.in_flight.get(event.request_id)
                if item is not None:
                    self._fail(item, f"engine error: {event.error}")
            elif isinstance(event, EngineCrashed):
                log.error("engine crashed", error=event.error)
                self._requeue_all(f"engine crashed: {event.error}", count_crash=True)
                self.exit_code = 1
                return False
        return True

    def _on_step(self, event: StepOutputs) -> None:
        now = time.monotonic()
        entries: list = []
        ends: list[Ending] = []
        for output in event.outputs:
            item = self.in_flight.get(output.request_id)
            if item is None:
                continue  # canceled, timed out or lost meanwhile
            item.last_output = output
            if output.finished and item.request is not None and item.request.task == "embed":
                del self.in_flight[item.job_id]
                ends.append(self.ender.finish(item, output))
                continue
            self._observe_tokens(item, output, event.time)
            if output.finished:
                del self.in_flight[item.job_id]
                self.window.discard(item.job_id)
                ending = self.ender.finish(item, output, stream_entries(item))
                entries += ending.entries  # its last tokens go with its end
                # A streamed job's reader waits on its final entry: written with this step.
                window = self.config.bulk_coalesce_window if item.claim.bulk else None
                if item.stream.enabled or not self.endings.hold(ending, now, window):
                    ends.append(ending)
            elif item.stream.enabled and item.stream.num_new(output.outputs[0]) > 0:
                first = item.stream.num_tokens == 0
                if self.window.add(item.job_id, now, first):
                    entries += stream_entries(item)
        if self.window.due(now):
            entries += window_entries(self.window.take(), self.in_flight)
        if entries or ends or self.endings.due(now):
            self._write_ends(ends, entries)

    def _write_ends(self, ends: list[Ending], entries: list | None = None) -> None:
        """Write stream entries and endings, with every ending waiting in the coalescer, in one
        round trip: one STEP call (one STREAM and one END call when their jobs are of several
        shards). The tokens waiting for their window do not go along: taken early, they make
        more, smaller entries, which cost Redis more than the calls saved (bench/redis_mix.py:
        1.04x the instructions per streamed job)."""
        ends = self.endings.take() + ends
        write = step_write(self.adapter, entries or [], ends)
        if write.calls:
            self.link.run(write.calls, lambda replies: self._on_step_written(write, replies, ends))

    def _on_step_written(self, write: StepWrite, replies: list, ends: list[Ending]) -> None:
        streamed, ended = write.read(replies)
        if streamed is not None:
            for job_id in self.adapter.stream_lost(streamed):
                self._drop(job_id, "lease lost: stream entry refused")
        for ending, reply in zip(ends, ended, strict=True):
            self.ender.ended(ending, reply)

    def _observe_tokens(self, item: InFlight, output: Any, t: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        num_new, item.num_tokens_seen = num_tokens - item.num_tokens_seen, num_tokens
        if item.first_token_at is None and output.outputs[0].token_ids:
            item.first_token_at = t
            self.metrics.observe_first_token(t - item.enqueued_at)
            since = None
        else:
            since = t - item.last_token_at if item.last_token_at else None
        self.metrics.observe_new_tokens(max(0, num_new), since)
        item.last_token_at = t

    # --- endings other than finished ------------------------------------------------------------

    def _fail(self, item: InFlight, message: str) -> None:
        self.in_flight.pop(item.job_id, None)
        self.loop.abort(item.job_id)
        self.ender.fail(item, message)

    def _cancel(self, job_id: str) -> None:
        item = self.in_flight.pop(job_id)
        self.loop.abort(job_id)
        self.ender.cancel(item)

    def _drop(self, job_id: str, why: str) -> None:
        """Forget a job whose lease is gone: another worker runs it now."""
        item = self.in_flight.pop(job_id, None)
        if item is not None:
            self.loop.abort(job_id)
            log.warning("dropped job", job_id=job_id, reason=why)

    def _requeue_all(self, reason: str, *, count_crash: bool) -> None:
        """Put every in-flight job back at the front of its queue (at-least-once delivery)."""
        if self.in_flight:
            count = len(self.in_flight)
            self._requeue(list(self.in_flight), reason, count_crash=count_crash)
            log.warning("requeued in-flight jobs", count=count, reason=reason)

    def _requeue(self, job_ids: list[str], reason: str, *, count_crash: bool) -> None:
        """Take these in-flight jobs out of the engine and put them back at the front of their
        queues."""
        items = [self.in_flight.pop(job_id) for job_id in job_ids]
        for item in items:
            self.loop.abort(item.job_id)
            self.window.discard(item.job_id)
        self.ender.requeue(items, count_crash=count_crash, reason=reason)

    def _handle_cancels(self) -> None:
        while True:
            try:
                job_id = self.cancels.job_ids.get_nowait()
            except queue_mod.Empty:
                break
            if job_id in self.in_flight:
                self._cancel(job_id)
        t = time.monotonic()
        if self.in_flight and self.link.up and t >= self._next_cancel_poll_at:
            # A fallback for cancel messages published while our pub/sub connection was down.
            self._next_cancel_poll_at = t + CANCEL_POLL_S
            job_ids = list(self.in_flight)
            ok, flags = self.link.attempt(
                lambda: self.link.scripts.call(self.adapter.cancel_check(job_ids))
            )
            for job_id, flag in zip(job_ids, flags or [], strict=False):
                if flag is not None and job_id in self.in_flight:
                    self._cancel(job_id)

    def _enforce_timeouts(self) -> None:
        t = time.monotonic()
        for item in [i for i in self.in_flight.values() if t >= i.deadline]:
            self._fail(item, "timeout")

    # --- leases -------------------------------------------------------------------------------

    def _maintain(self) -> None:
        if not self.link.up:
            return
        if self.leases.heartbeat_due():
            self._heartbeat()
        if self.leases.reap_due():
            ok, reaped = self.link.attempt(lambda: self.link.scripts.call(self.adapter.reap_call()))
            if ok and (reaped[0] or reaped[1]):
                requeued, failed = ([j.decode() for j in ids] for ids in reaped)
                log.warning("reaped expired leases", requeued=requeued, failed=failed)

    def _heartbeat(self) -> None:
        claims = [i.claim for i in self.in_flight.values()]
        claims += [e.claim for e in self.endings.pending if e.claim is not None]
        call = self.adapter.heartbeat_call(claims, "busy" if claims else "idle")
        ok, lost = self.link.attempt(lambda: self.link.scripts.call(call))
        if ok:
            self.health.redis_ok()
        for member in lost or []:
            job_id = member.decode().rsplit(":", 1)[0]
            item = self.in_flight.get(job_id)
            if item is not None and item.claim.member == member.decode():
                self._drop(job_id, "lease lost: another worker reaped it")

    def _publish_status(self) -> None:
        """Keep `pagedq status` fresh (StatusPublisher writes at most every half second)."""
        if self.link.up:
            self.status.maybe_publish()
        else:
            self.health.redis_error("unreachable: buffering writes until it is back")

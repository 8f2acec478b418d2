"""How a job ends: finished, failed, canceled or requeued, always through RQ's own handlers.

A mixin of BatchWorker (which provides the RQ worker, the engine loop and `in_flight`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog
from rq.exceptions import InvalidJobOperation
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import now

from producer.schema import result_key, stream_key
from worker.inflight import InFlight
from worker.jobs import build_result
from worker.streams import xadd

log = structlog.get_logger("pagedq.worker")


class JobEndingsMixin:
    """Ends in-flight jobs: RQ bookkeeping first, then the result key and the final stream entry."""

    def _timings(self, item: InFlight) -> dict[str, float | None]:
        end = time.time()
        first = item.first_token_at
        return {
            "queued_s": round(item.started_at - item.enqueued_at, 6),
            "ttft_s": round(first - item.enqueued_at, 6) if first else None,
            "total_s": round(end - item.enqueued_at, 6),
        }

    def _result(
        self, item: InFlight, output: Any, status: str, error: str | None = None
    ) -> dict[str, Any]:
        return build_result(
            item.job.id,
            item.request,
            output,
            status=status,
            model=self.engine.model_name,
            worker=self.name,
            timings=self._timings(item),
            error=error,
        ).model_dump(mode="json")

    def _publish(self, pipe: Any, job_id: str, result: dict, final: dict[str, str]) -> None:
        """Write the plain JSON result key and the stream's final entry."""
        pipe.set(result_key(job_id), json.dumps(result), ex=self.config.result_ttl)
        xadd(pipe, stream_key(job_id), final, self.config.stream_ttl)

    # --- ending jobs through RQ ---------------------------------------------------------------

    def _succeed(self, item: InFlight, output: Any, result: dict[str, Any]) -> None:
        self.in_flight.pop(item.job.id, None)
        job = item.job
        job._result = result
        job.ended_at = now()
        job._status = JobStatus.FINISHED
        self.handle_job_success(
            job=job,
            queue=item.queue,
            started_job_registry=item.queue.started_job_registry,
            execution=item.execution,
        )
        self.num_ended += 1
        self.metrics.jobs.labels("finished").inc()
        self.metrics.prompt_tokens.inc(len(output.prompt_token_ids or []))
        self.metrics.e2e_latency.observe(time.time() - item.enqueued_at)
        log.info("job finished", job_id=job.id, tokens=len(output.outputs[0].token_ids))

    def _fail(self, item: InFlight, message: str) -> None:
        """End a started job as failed, for good (its error is in the request, not the worker)."""
        self.in_flight.pop(item.job.id, None)
        self.loop.abort(item.job.id)
        result = self._result(item, item.last_output, "failed", error=message)
        self._rq_fail(item.job, item.queue, item.execution, message)
        with self.connection.pipeline(transaction=False) as pipe:
            self._publish(pipe, item.job.id, result, {"event": "error", "error": message})
            pipe.execute()

    def _fail_unstarted(self, job: Job, queue: Queue, execution: Execution, message: str) -> None:
        result = build_result(
            job.id,
            None,
            None,
            status="failed",
            model=self.engine.model_name,
            worker=self.name,
            timings={},
            error=message,
        ).model_dump(mode="json")
        self._rq_fail(job, queue, execution, message)
        with self.connection.pipeline(transaction=False) as pipe:
            self._publish(pipe, job.id, result, {"event": "error", "error": message})
            pipe.execute()

    def _rq_fail(self, job: Job, queue: Queue, execution: Execution, message: str) -> None:
        job.ended_at = now()
        job.retries_left = 0  # a bad request fails the same way every time: never retry it
        job._status = JobStatus.FAILED
        self.handle_job_failure(job, queue, exc_string=message, execution=execution)
        self.num_ended += 1
        self.metrics.jobs.labels("failed").inc()
        log.warning("job failed", job_id=job.id, error=message)

    def _cancel(self, job_id: str) -> None:
        """Abort a running job, free its blocks, and end it in RQ's canceled registry."""
        item = self.in_flight.pop(job_id)
        self.loop.abort(job_id)
        job = item.job
        # One transaction, so a reader never sees the canceled result while RQ says "started".
        with self.connection.pipeline() as pipe:
            try:
                job.cancel(pipeline=pipe)
            except InvalidJobOperation:
                pass  # the producer already canceled it through RQ
            self.cleanup_execution(job, pipeline=pipe, execution=item.execution)
            result = self._result(item, item.last_output, "canceled", error="canceled")
            self._publish(pipe, job_id, result, {"event": "error", "error": "canceled"})
            pipe.execute()
        self.num_ended += 1
        self.metrics.jobs.labels("canceled").inc()
        log.info("job canceled", job_id=job_id)

    def _requeue_all(self, reason: str) -> None:
        """Put every in-flight job back at the front of its queue (at-least-once delivery)."""
        if not self.in_flight:
            return
        items = list(self.in_flight.values())
        self.in_flight.clear()
        for item in items:
            self.loop.abort(item.job.id)
        with self.connection.pipeline() as pipe:
            for item in items:
                self.cleanup_execution(item.job, pipeline=pipe, execution=item.execution)
                item.queue._enqueue_job(item.job, pipeline=pipe, at_front=True)
            pipe.execute()
        log.warning("requeued in-flight jobs", count=len(items), reason=reason)

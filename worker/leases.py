"""Leases and cancels: batched heartbeats of every in-flight execution, and the lease reaper.

A mixin of BatchWorker. An execution's lease (its score in RQ's StartedJobRegistry) lasts
lease_ttl seconds; a worker that stops heartbeating (it died) loses its jobs to the reaper of
another worker, which re-runs them through RQ's retry.
"""

from __future__ import annotations

import json
import queue as queue_mod
import time

import structlog
from rq.utils import now
from rq.worker import WorkerStatus

from producer.schema import cancel_key, worker_key

log = structlog.get_logger("pagedq.worker")


class LeasesMixin:
    """Heartbeats, the lease reaper and cancel handling of BatchWorker."""

    def _handle_cancels(self) -> None:
        while True:
            try:
                job_id = self._cancels.get_nowait()
            except queue_mod.Empty:
                return
            if job_id in self.in_flight:
                self._cancel(job_id)

    def _poll_cancel_keys(self) -> None:
        # A fallback for cancel messages published while our pub/sub connection was down.
        job_ids = list(self.in_flight)
        flags = self.connection.mget([cancel_key(j) for j in job_ids])
        for job_id, flag in zip(job_ids, flags, strict=True):
            if flag is not None:
                self._cancel(job_id)

    def _heartbeat_all(self) -> None:
        """Renew the worker's and every in-flight execution's lease in one pipeline."""
        ttl = self.config.lease_ttl
        stats = self.loop.stats
        with self.connection.pipeline(transaction=False) as pipe:
            self.heartbeat(pipeline=pipe)
            for item in self.in_flight.values():
                item.execution.heartbeat(item.queue.started_job_registry, ttl, pipeline=pipe)
                item.job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            status = {
                "in_flight": len(self.in_flight),
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage,
                "model": self.engine.model_name,
                "queue": self.config.queue,
                "updated_at": time.time(),
            }
            pipe.set(worker_key(self.name), json.dumps(status), ex=max(5, ttl))
            if not self.in_flight and self.get_state() == WorkerStatus.BUSY:
                self.set_state(WorkerStatus.IDLE, pipeline=pipe)
            pipe.execute()
        self.metrics.observe_stats(stats, len(self.in_flight))

    def _reap_expired_leases(self) -> None:
        """Re-run (RQ retry) or fail jobs whose worker died: their execution leases expired."""
        for queue in self.queues:
            # RQ's own maintenance lock, so two workers never retry the same abandoned job twice.
            if queue.acquire_maintenance_lock():
                try:
                    queue.started_job_registry.cleanup(exception_handlers=self._exc_handlers)
                finally:
                    queue.release_maintenance_lock()

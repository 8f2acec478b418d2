"""The doorbell: rings producers push when they enqueue, heard on a thread, so that a worker
with room waits for work instead of polling an empty queue.

Every enqueue call pushes one ring per BELL_JOBS jobs to the bell list of each base queue it
filled (`pagedq:bell:<base>`, producer/enqueue.py), and a DEQUEUE that leaves jobs queued rings
once more. While the control loop has room and found its queues empty it `want`s: the thread
then blocks in BLPOP on its bells, and each ring wakes exactly one waiting worker (no herd),
which asks the queue at once. A worker with jobs in flight used to ask every 0.1 s and an idle
one every 0.25 s: each ask is a script call, about 100 µs of Redis CPU, for nothing. They still
ask every `SAFETY_POLL_S` for jobs no producer rang for (plain RQ producers). A job put back
(REQUEUE, the reaper) rings for itself.

Redis Cluster has no BLPOP across slots: there the bell is off and workers poll as before.
"""

from __future__ import annotations

import threading

import redis
import structlog

log = structlog.get_logger("pagedq.worker")
# How long one BLPOP blocks: the thread sees `stop` and a change of `want` this often.
BLOCK_S = 1.0
RECONNECT_S = 1.0
# How often a worker waiting on its bell still asks its queues, for jobs that came unrung.
SAFETY_POLL_S = 2.0


class Doorbell:
    """BLPOPs the bells of a worker's base queues while the control loop wants work; `rang`
    is set when a ring came."""

    def __init__(self, connection: redis.Redis | None, keys: list[str]) -> None:
        # None (Redis Cluster, or no keys): never rings; the control loop polls.
        self.enabled = connection is not None and bool(keys)
        self.connection = connection
        self.keys = keys
        self.rang = threading.Event()
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="doorbell", daemon=True)

    def start(self) -> None:
        """Start listening (a no-op when disabled)."""
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        """Stop listening (within about BLOCK_S)."""
        self._stop.set()
        self._wanted.set()
        if self._thread.is_alive():
            self._thread.join(BLOCK_S + 1.0)

    def want(self, wanted: bool) -> None:
        """Whether the control loop has room and found nothing queued (a ring is taken only
        then: a ring taken by a full worker would be lost to the others)."""
        if wanted:
            self._wanted.set()
        else:
            self._wanted.clear()

    def _run(self) -> None:
        assert self.connection is not None
        while not self._stop.is_set():
            if not self._wanted.wait(BLOCK_S) or self._stop.is_set():
                continue
            try:
                reply = self.connection.blpop(self.keys, timeout=BLOCK_S)
            except (redis.ConnectionError, redis.TimeoutError):
                self._stop.wait(RECONNECT_S)
                continue
            except redis.RedisError as exc:  # e.g. an ACL without BLPOP: poll instead
                log.warning("doorbell off: polling the queue", error=str(exc))
                self.enabled = False
                self.rang.set()  # the control loop asks the queue now, then polls
                return
            if reply is not None:
                self.rang.set()
                self._wanted.clear()  # until the control loop asked the queue

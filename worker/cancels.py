"""Cancel requests published on `pagedq:cancel`, heard on a thread that reconnects on its own."""

from __future__ import annotations

import queue
import threading

import redis
import structlog

from producer.contract.keys import CANCEL_CHANNEL

log = structlog.get_logger("pagedq.worker")
RECONNECT_S = 1.0


class CancelListener:
    """Subscribes to the cancel channel; job ids land in `job_ids` for the control thread.

    Messages published while the connection is down are lost: the control loop also checks
    the cancel keys of its in-flight jobs every second.
    """

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection
        self.job_ids: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cancels", daemon=True)

    def start(self) -> None:
        """Start listening."""
        self._thread.start()

    def stop(self) -> None:
        """Stop listening (within about a second)."""
        self._stop.set()
        self._thread.join(3)

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = self.connection.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CANCEL_CHANNEL)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message.get("type") == "message":
                        data = message["data"]
                        self.job_ids.put(data.decode() if isinstance(data, bytes) else str(data))
            except (redis.ConnectionError, redis.TimeoutError):
                self._stop.wait(RECONNECT_S)
            finally:
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001 - the connection is already gone
                    pass

"""Every command a redis-server runs, as MONITOR reports it, collected on a thread (tests
that count what a worker or a hub sends)."""

from __future__ import annotations

import threading
import time


class CommandLog:
    """The commands Redis runs from now on: `(monotonic time, command line)` each."""

    def __init__(self, redis) -> None:
        self.commands: list[tuple[float, str]] = []
        self._redis = redis  # its connection lives as long as this log
        self._monitor = redis.monitor()
        self._monitor.connection.send_command("MONITOR")
        self._monitor.connection.read_response()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        try:
            for cmd in self._monitor.listen():
                self.commands.append((time.monotonic(), cmd["command"]))
        except Exception:  # the connection closed at the end of the test
            pass

    def words(self, name: str) -> list[list[str]]:
        """The words of each command `name` (any case) run so far."""
        out = []
        for _, line in list(self.commands):
            words = line.split()
            if words and words[0].lower() == name.lower():
                out.append(words)
        return out

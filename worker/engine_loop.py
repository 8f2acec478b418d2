"""The engine thread: steps the engine while the control thread talks to Redis.

The control thread never touches the engine directly. It puts `AddRequest` and `AbortRequest`
commands on a queue and reads `StepOutputs` / `AddFailed` events from another. One lock guards
the engine; the engine thread holds it for a step, the control thread for `can_admit` and for
short admission bursts (`paused()`), so many jobs can join the batch between two steps.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# After a step that freed batch slots, the engine waits at most this long for the control thread
# to admit queued jobs, so they join at the very next step (as vLLM's scheduler would take them).
ADMISSION_WAIT_S = 0.25


@dataclass(slots=True)
class AddRequest:
    """Command: add one request to the running batch."""

    request_id: str
    prompt: str | list[int]
    params: Any  # engine.SamplingParams
    priority: int = 0


@dataclass(slots=True)
class AbortRequest:
    """Command: abort one request and free its blocks."""

    request_id: str


@dataclass(slots=True)
class AddFailed:
    """Event: the engine refused a request (its ValueError message)."""

    request_id: str
    error: str


@dataclass(slots=True)
class StepOutputs:
    """Event: the outputs of one engine step, with the wall time they appeared."""

    outputs: list[Any]  # list[engine.RequestOutput]
    time: float = field(default_factory=time.time)


@dataclass(slots=True)
class EngineCrashed:
    """Event: the engine thread died; the worker must stop."""

    error: str


class EngineLoop:
    """Owns an `LLMEngine` and steps it on its own daemon thread."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = engine.get_stats()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._control_waiting = 0
        self._admitted = threading.Event()
        # The control thread clears this while the queue is known to be empty or it is stopping.
        self.wait_for_admission = True
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """Start stepping."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def add(self, command: AddRequest) -> None:
        """Queue a request for the running batch."""
        self.commands.put(command)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Queue an abort; unknown ids are ignored by the engine."""
        self.commands.put(AbortRequest(request_id))
        self._wake.set()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between two steps (for an admission burst)."""
        self._control_waiting += 1
        try:
            with self._lock:
                yield
        finally:
            self._control_waiting -= 1

    def admitted(self) -> None:
        """The control thread has admitted what it could; the engine may step again."""
        self._admitted.set()

    def can_admit(self) -> bool:
        """True when the engine can take one more request now, counting queued adds."""
        with self.paused():
            self._apply_commands()
            return bool(self.engine.can_admit())

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AbortRequest):
                self.engine.abort_request(command.request_id)
                continue
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.params, priority=command.priority
                )
            except ValueError as exc:
                self.events.put(AddFailed(command.request_id, str(exc)))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                with self._lock:
                    self._apply_commands()
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    self.stats = self.engine.get_stats()
                if outputs:
                    self._admitted.clear()
                    self.events.put(StepOutputs(outputs))
                    if self.wait_for_admission and any(o.finished for o in outputs):
                        self._admitted.wait(ADMISSION_WAIT_S)
                if not busy:
                    self._wake.wait(0.05)
                elif self._control_waiting:
                    # Locks are not fair: let the waiting control thread in between steps.
                    time.sleep(0.001)
        except Exception as exc:  # noqa: BLE001 - reported to the control thread, which exits
            self.events.put(EngineCrashed(f"{type(exc).__name__}: {exc}"))

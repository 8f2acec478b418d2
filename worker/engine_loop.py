"""The engine thread: steps the engine while the control thread talks to Redis.

The control thread never touches the engine directly. It puts `AddRequest` and `AbortRequest`
commands on a queue and reads `StepOutputs` / `AddFailed` / `RequestFailed` events from another.
One lock guards the engine; the engine thread holds it for a step, the control thread for
`admission` and for short admission bursts (`paused()`), so many jobs can join the batch
between two steps.

Nothing a job carries is worked on by the control thread: a tokenizer thread turns each
`AddRequest`'s prompt text or chat messages into token ids with the engine's own prompt
handling (`engine.prompts.copy()`: its own copy of the tokenizer; the fast tokenizer lets go of
the GIL meanwhile), so a megabyte prompt delays its own job only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# After a step that freed batch slots, the engine waits at most this long for the control thread
# to admit queued jobs, so they join at the very next step (as vLLM's scheduler would take them).
ADMISSION_WAIT_S = 0.25


# Jobs handed to the tokenizer thread but not yet to the engine: past this, admit no more.
MAX_PENDING_ADDS = 8


class Admission(NamedTuple):
    """What one dequeue may claim: `room` to run now, `ahead` to wait in the engine (bulk
    jobs, worker/config.py --prefetch), and the `prefetch` limit that was applied."""

    room: int
    ahead: int
    prefetch: int


@dataclass(slots=True)
class AddRequest:
    """Command: add one request to the running batch. `prompt` is a text, token ids or chat
    messages ([{role, content}]) until the tokenizer thread makes it a ProcessedPrompt."""

    request_id: str
    prompt: Any  # engine.prompts.Prompt, then engine.prompts.ProcessedPrompt
    params: Any  # engine.SamplingParams
    priority: int = 0
    tenant: str | None = None


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
class RequestFailed:
    """Event: an engine step raised because of this request; step isolation ended it alone
    (the others go on). Fail the job without retry: it would fail the same way anywhere."""

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

    def __init__(self, engine: Any, on_step: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        # Called on the engine thread after each step with its scheduled tokens (metrics).
        self.on_step = on_step
        # Wall time of the latest step that ran (None before the first one).
        self.last_step_at: float | None = None
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
        self._to_tokenize: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_lock = threading.Lock()
        self._pending: set[str] = set()
        self._canceled: set[str] = set()
        self._prompts = engine.prompts.copy()
        self._tokenizer_thread = threading.Thread(
            target=self._tokenize_forever, name="tokenizer", daemon=True
        )

    def start(self) -> None:
        """Start stepping (and tokenizing)."""
        self._thread.start()
        self._tokenizer_thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the threads after their current step / prompt."""
        self._stop.set()
        self._wake.set()
        self._to_tokenize.put(None)
        self._thread.join(timeout)
        self._tokenizer_thread.join(timeout)

    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive()

    def add(self, command: AddRequest) -> None:
        """Queue a request for the running batch (tokenized first, off the caller's thread)."""
        with self._pending_lock:
            self._pending.add(command.request_id)
        self._to_tokenize.put(command)

    def abort(self, request_id: str) -> None:
        """Queue an abort; unknown ids are ignored by the engine."""
        with self._pending_lock:
            if request_id in self._pending:
                self._canceled.add(request_id)
        self.commands.put(AbortRequest(request_id))
        self._wake.set()

    @property
    def num_pending_adds(self) -> int:
        """Requests given to `add` that the engine has not received yet."""
        with self._pending_lock:
            return len(self._pending)

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

    def admission(self, prefetch: int) -> Admission:
        """How many more requests the engine can take now (0 to MAX_PENDING_ADDS, counting
        queued adds: what one dequeue may claim), and how many more may be added to wait in it
        so that at most `prefetch` wait there (queued adds included; -1: a quarter of the
        requests running): what a dequeue may claim ahead."""
        with self.paused():
            self._apply_commands()
            # Adds still being tokenized are requests the engine does not hold yet.
            pending = self.num_pending_adds
            room = MAX_PENDING_ADDS - pending
            while room > 0 and not self.engine.can_admit(num_requests=room + pending):
                room //= 2
            waiting = pending + self.engine.scheduler.num_waiting
            if prefetch < 0:
                prefetch = len(self.engine.scheduler.running) // 4
        return Admission(max(room, 0), max(0, prefetch - waiting), prefetch)

    def not_begun(self) -> list[str]:
        """Ids of the requests given to `add` that the engine has not begun: still being
        tokenized, or waiting with no token computed or sampled (what a stopping worker can
        hand back at once)."""
        with self.paused():
            self._apply_commands()
            with self._pending_lock:
                ids = list(self._pending)
            ids += [
                r.request_id
                for r in self.engine.scheduler.waiting
                if not r.num_computed_tokens and not r.num_output_tokens
            ]
        return ids

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AbortRequest):
                self.engine.abort_request(command.request_id)
                continue
            # An embedding request (PoolingParams) carries a list of inputs.
            add = (
                self.engine.add_embedding_request
                if hasattr(command.params, "pooling")
                else self.engine.add_request
            )
            try:
                add(
                    command.request_id,
                    command.prompt,
                    command.params,
                    command.priority,
                    tenant=command.tenant,
                )
            except ValueError as exc:
                self.events.put(AddFailed(command.request_id, str(exc)))

    # --- tokenizer thread -------------------------------------------------------------------
    def _tokenize_forever(self) -> None:
        while not self._stop.is_set():
            command = self._to_tokenize.get()
            if command is None:
                return
            ready: AddRequest | AddFailed = command
            try:
                command.prompt = self._process(command)
            except ValueError as exc:
                ready = AddFailed(command.request_id, str(exc))
            except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the job's
                ready = AddFailed(command.request_id, f"{type(exc).__name__}: {exc}")
            with self._pending_lock:
                self._pending.discard(command.request_id)
                if command.request_id in self._canceled:
                    self._canceled.discard(command.request_id)
                    continue
                if isinstance(ready, AddFailed):
                    self.events.put(ready)
                else:
                    self.commands.put(ready)
            self._wake.set()

    def _process(self, command: AddRequest) -> Any:
        if not hasattr(command.params, "pooling"):
            return self._prompts.process(command.prompt)
        processed = []
        for i, prompt in enumerate(command.prompt):
            try:
                processed.append(self._prompts.process(prompt))
            except ValueError as exc:
                raise ValueError(f"input[{i}]: {exc}") from None
        return processed

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                with self._lock:
                    self._apply_commands()
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    failed = dict(self.engine.pop_failed_requests())
                    self.stats = self.engine.get_stats()
                if busy:
                    self.last_step_at = time.time()
                    if self.on_step is not None:
                        self.on_step(self.stats.num_scheduled_tokens)
                if failed:
                    # The culprit's final "abort" output is not a finish: it is a failure.
                    outputs = [o for o in outputs if o.request_id not in failed]
                    for request_id, error in failed.items():
                        self.events.put(RequestFailed(request_id, error))
                if outputs:
                    self._admitted.clear()
                    self.events.put(StepOutputs(outputs))
                    if self.wait_for_admission and any(o.finished for o in outputs):
                        self._admitted.wait(ADMISSION_WAIT_S)
                if not busy:
                    self.engine.check_ranks()  # an idle worker notices a lost rank too
                    self._wake.wait(0.05)
                elif self._control_waiting:
                    # Locks are not fair: let the waiting control thread in between steps.
                    time.sleep(0.001)
        except Exception as exc:  # noqa: BLE001 - reported to the control thread, which exits
            self.events.put(EngineCrashed(f"{type(exc).__name__}: {exc}"))

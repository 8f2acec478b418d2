"""When a worker writes to Redis: endings and dequeues gathered into fewer, larger script calls.

Redis pays a fixed cost per script call (the round trip, the picker's reads, the registry and
counter writes of an END) and a smaller one per job in it. Measured with one quiet client
(docs/OPERATIONS.md, "Capacity"): END costs 47 us per job one at a time and 22 us in calls of
32; DEQUEUE 45 and 12 us. A busy worker ends about one job per engine step and has room for
one more after it, so without gathering every call holds one job.

- `EndCoalescer` holds the endings of jobs that nobody streams (their reader polls the result
  key) for at most their window (`window_s`, or a longer one for bulk jobs, whose ends are read
  from an events stream), or until `max_endings` wait, and hands them back to be written in one
  END call. A job that streams is written at once, taking the waiting ones along.
- `StreamWindow` holds the new tokens of the jobs that stream for at most one window
  (`--stream-interval`) from the oldest one sampled, then hands back every job with tokens
  waiting, to be written in one STREAM call (one entry per job carrying all its tokens of the
  window). A job's first token is written at once, and its last with its end.
- `AdmissionGate` lets a dequeue run once the engine has room for `min_jobs` jobs, or has had
  room for `window_s`, or is nearly empty (then at once: an idle worker never waits).

`window_s = 0` turns each off: every step writes its own endings, every free slot is claimed
at once. A job held here is still started under this worker's lease in Redis: heartbeats cover
it, and if the worker dies before the write, the job runs again elsewhere (nothing is lost).
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")

# Endings written in one call at most, and the jobs one dequeue waits to have room for.
MAX_COALESCED_ENDINGS = 64
MIN_DEQUEUE_JOBS = 4


class EndCoalescer(Generic[T]):
    """Endings waiting to be written together (see the module docstring)."""

    def __init__(self, window_s: float, max_endings: int = MAX_COALESCED_ENDINGS) -> None:
        self.window_s = window_s
        self.max_endings = max(1, max_endings)
        self.pending: list[T] = []
        self._due_at = float("inf")

    def hold(self, ending: T, now: float, window_s: float | None = None) -> bool:
        """Keep `ending` for at most `window_s` (default: the coalescer's); False when it must
        be written now (a window of 0)."""
        window = self.window_s if window_s is None else window_s
        if window <= 0:
            return False
        self._due_at = min(self._due_at, now + window)
        self.pending.append(ending)
        return True

    def due(self, now: float) -> bool:
        """True when the waiting endings should be written now."""
        return bool(self.pending) and (len(self.pending) >= self.max_endings or now >= self._due_at)

    def take(self) -> list[T]:
        """Every waiting ending, oldest first; the coalescer is empty after."""
        taken, self.pending, self._due_at = self.pending, [], float("inf")
        return taken

    def wait_s(self, now: float) -> float | None:
        """Seconds until the waiting endings are due (None: none waits)."""
        if not self.pending:
            return None
        return max(0.0, self._due_at - now)


class StreamWindow:
    """Jobs whose streamed tokens wait to be written together (see the module docstring)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.waiting: dict[str, None] = {}  # job ids, in the order their tokens came
        self._due_at = float("inf")

    def add(self, job_id: str, now: float, first: bool) -> bool:
        """New tokens of `job_id` were sampled at `now`: True when they must be written now
        (the job's first token, or a window of 0); else they wait for the window."""
        if first or self.interval_s <= 0:
            self.waiting.pop(job_id, None)
            return True
        if not self.waiting:
            self._due_at = now + self.interval_s
        self.waiting[job_id] = None
        return False

    def discard(self, job_id: str) -> None:
        """`job_id`'s tokens are written otherwise (it ended) or never will be."""
        self.waiting.pop(job_id, None)
        if not self.waiting:
            self._due_at = float("inf")

    def due(self, now: float) -> bool:
        """True when the waiting tokens should be written now."""
        return bool(self.waiting) and now >= self._due_at

    def take(self) -> list[str]:
        """Every job with tokens waiting; the window is empty after."""
        taken, self.waiting, self._due_at = list(self.waiting), {}, float("inf")
        return taken

    def wait_s(self, now: float) -> float | None:
        """Seconds until the waiting tokens are due (None: none waits)."""
        if not self.waiting:
            return None
        return max(0.0, self._due_at - now)


class AdmissionGate:
    """Whether a dequeue should run now for the engine's `room` (see the module docstring)."""

    def __init__(self, window_s: float, min_jobs: int = MIN_DEQUEUE_JOBS) -> None:
        self.window_s = window_s
        self.min_jobs = max(1, min_jobs)
        self._room_since: float | None = None

    def ready(self, room: int, in_flight: int, now: float) -> bool:
        """True when a dequeue for `room` jobs should run, with `in_flight` jobs held."""
        if room <= 0:
            self._room_since = None
            return False
        if self.window_s <= 0 or room >= self.min_jobs or in_flight < self.min_jobs:
            return True
        if self._room_since is None:
            self._room_since = now
        return now - self._room_since >= self.window_s

    def dequeued(self) -> None:
        """A dequeue ran: the wait for room starts over."""
        self._room_since = None

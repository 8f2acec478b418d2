"""Waiting queues for the two scheduling policies: FCFS and priority with aging."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from engine.request import Request


class FCFSQueue:
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """Queue a new request at the back."""
        self._queue.append(request)

    def readd_preempted(self, request: Request) -> None:
        """Queue a preempted request ahead of every newer one."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The next request to admit."""
        return self._queue[0]

    def pop(self) -> Request:
        """Remove and return the next request."""
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Drop ``request`` (an abort)."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)


class PriorityQueue:
    """Lowest ``priority`` first, then earliest arrival; waiting requests age.

    With aging, the effective priority is ``priority - waited_seconds / aging_seconds``. Since
    ``now`` shifts every request equally, ordering by ``priority + arrival / aging`` is the same
    order at any moment, so the heap key never needs updating.
    """

    def __init__(self, aging_seconds: float | None = None) -> None:
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[float, float, int, Request]] = []
        self._counter = itertools.count()
        self._removed: set[int] = set()

    def key(self, request: Request) -> tuple[float, float]:
        """Sort key of ``request``: smaller runs first."""
        age_term = request.arrival_time / self.aging_seconds if self.aging_seconds else 0.0
        return (request.priority + age_term, request.arrival_time)

    def add(self, request: Request) -> None:
        """Queue a request by its key."""
        heapq.heappush(self._heap, (*self.key(request), next(self._counter), request))

    readd_preempted = add  # its original arrival time already puts it ahead of newer peers

    def _prune(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request:
        """The next request to admit."""
        self._prune()
        return self._heap[0][3]

    def pop(self) -> Request:
        """Remove and return the next request."""
        self._prune()
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """Drop ``request`` lazily."""
        self._removed.add(id(request))

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap) if id(e[3]) not in self._removed)


def make_request_queue(policy: str, aging_seconds: float | None = None):
    """The waiting queue for ``policy`` ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_seconds)
    raise ValueError(f"scheduling_policy={policy!r} is invalid: must be 'fcfs' or 'priority'")

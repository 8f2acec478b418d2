"""Waiting queues of the scheduling policies: FCFS, priority with aging, fair (per tenant)."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

from engine.fair import FairShare, tenant_of
from engine.request import Request

POLICIES = ("fcfs", "priority", "fair")


def aged_priority(request: Request, now: float, aging_seconds: float | None) -> float:
    """``priority`` lowered by 1 for every ``aging_seconds`` the request has waited."""
    if not aging_seconds:
        return float(request.priority)
    return request.priority - max(now - request.arrival_time, 0.0) / aging_seconds


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


class FairQueue:
    """One priority queue per tenant; the next request is the head with the smallest key.

    The key of a tenant's head is ``(floor(aged priority), virtual finish time, arrival)``:
    priority (with aging) first, then weighted fair queueing between tenants. With one tenant
    this is exactly the priority policy.
    """

    def __init__(
        self,
        fair: FairShare,
        aging_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fair = fair
        self.aging_seconds = aging_seconds
        self.clock = clock
        self._queues: dict[str, PriorityQueue] = {}
        self._peeked: PriorityQueue | None = None

    def key(self, request: Request, now: float) -> tuple[float, float, float]:
        """Sort key of a tenant's head request: smaller runs first."""
        band = math.floor(aged_priority(request, now, self.aging_seconds))
        return (band, self.fair.virtual_finish_time(request, now), request.arrival_time)

    def add(self, request: Request) -> None:
        """Queue a request in its tenant's queue."""
        tenant = tenant_of(request)
        if tenant not in self._queues:
            self._queues[tenant] = PriorityQueue(self.aging_seconds)
        self._queues[tenant].add(request)
        self._peeked = None

    readd_preempted = add

    def _best(self) -> PriorityQueue:
        now = self.clock()
        queues = [q for q in self._queues.values() if len(q)]
        if not queues:
            raise IndexError("peek from an empty FairQueue")
        return min(queues, key=lambda q: self.key(q.peek(), now))

    def peek(self) -> Request:
        """The next request to admit; a ``pop`` right after takes this very one."""
        self._peeked = self._best()
        return self._peeked.peek()

    def pop(self) -> Request:
        """Remove and return the next request (the one the last ``peek`` returned)."""
        queue = self._peeked if self._peeked is not None else self._best()
        self._peeked = None
        return queue.pop()

    def remove(self, request: Request) -> None:
        """Drop ``request`` (an abort)."""
        self._queues[tenant_of(request)].remove(request)
        self._peeked = None

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self):
        # The pop order if nothing were charged meanwhile: merge the tenants' queues by key.
        now = self.clock()
        lists = [list(q) for q in self._queues.values() if len(q)]
        pos = [0] * len(lists)
        while True:
            heads = [
                (self.key(lst[p], now), i)
                for i, (lst, p) in enumerate(zip(lists, pos))
                if p < len(lst)
            ]
            if not heads:
                return
            _, i = min(heads)
            yield lists[i][pos[i]]
            pos[i] += 1


def make_request_queue(
    policy: str,
    aging_seconds: float | None = None,
    fair: FairShare | None = None,
    clock: Callable[[], float] = time.time,
):
    """The waiting queue for ``policy`` ("fcfs", "priority" or "fair")."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_seconds)
    if policy == "fair":
        return FairQueue(fair or FairShare(), aging_seconds, clock)
    raise ValueError(f"scheduling_policy={policy!r} is invalid: must be one of {list(POLICIES)}")

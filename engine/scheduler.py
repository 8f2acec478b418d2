"""Iteration-level scheduler: every step, token budget first to running, then to waiting."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_queue import make_request_queue


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    aging_seconds: float | None = None


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: its next ``num_new_tokens`` tokens."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner computes this step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests compute how many tokens; owns their blocks."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting = make_request_queue(config.policy, config.aging_seconds)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # scheduled slices shorter than what the request lacked

    def add_request(self, request: Request) -> None:
        """Queue a new request."""
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _preempt_key(self, request: Request) -> tuple[float, float]:
        # The latest arrival (or, by policy, the least urgent) is preempted first.
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.readd_preempted(request)

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        num_new = min(request.num_tokens - num_computed, token_budget)
        if num_new < request.num_tokens - num_computed:
            self.num_chunked_prefills += 1
        return num_new

    def schedule(self) -> SchedulerOutput:
        """Build the next step: running requests first, then waiting ones while blocks allow."""
        cfg = self.config
        out = SchedulerOutput()
        token_budget = cfg.max_num_batched_tokens
        kv = self.kv_cache_manager

        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, token_budget)
            assert num_new > 0, request
            while kv.allocate_slots(request, num_new) is None:
                # Only requests not yet scheduled this step are candidates, so no block that
                # this step will write is ever freed under it.
                victim = max(self.running[i:], key=self._preempt_key)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                continue
            out.scheduled.append(
                ScheduledRequest(request, num_new, kv.get_block_ids(request.request_id))
            )
            token_budget -= num_new
            i += 1

        # A step that had to preempt admits nothing new: the pool is known to be short.
        while (
            not out.preempted_ids
            and self.waiting
            and token_budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            request = self.waiting.peek()
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            if request.num_tokens - num_computed > token_budget and not cfg.enable_chunked_prefill:
                break
            num_new = self._num_new_tokens(request, num_computed, token_budget)
            if kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            self.running.append(request)
            out.scheduled.append(
                ScheduledRequest(request, num_new, kv.get_block_ids(request.request_id))
            )
            token_budget -= num_new

        assert token_budget >= 0
        assert len(self.running) <= cfg.max_num_seqs
        out.total_num_scheduled_tokens = cfg.max_num_batched_tokens - token_budget
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        return out

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` and free its blocks at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        if not request.status.finished:
            self.kv_cache_manager.free(request)
        request.status = status
        request.finished_time = time.time()
        self.requests.pop(request.request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted; returns it, or None if it is unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return bool(self.running) or bool(self.waiting)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet (including preempted ones)."""
        return len(self.waiting)

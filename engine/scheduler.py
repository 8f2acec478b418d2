"""Iteration-level scheduler: every step, token budget to running, then swapped, then waiting."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.fair import FairShare, TokenRate
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_queue import make_request_queue
from engine.swap import PreemptionCostModel, SwapSpace


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    aging_seconds: float | None = None
    tenant_weights: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: its next ``num_new_tokens`` tokens."""

    request: Request
    num_new_tokens: int
    block_ids: list[list[int]]  # per layer group


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner computes this step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    swapped_out_ids: list[str] = field(default_factory=list)
    swapped_in_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens of slices longer than one token (prompts, recomputes)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests compute how many tokens; owns their blocks."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        swap_space: SwapSpace | None = None,
        cost_model: PreemptionCostModel | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.swap_space = swap_space
        self.cost_model = cost_model
        self.clock = clock
        self.fair = FairShare(config.tenant_weights, config.aging_seconds)
        self.waiting = make_request_queue(config.policy, config.aging_seconds, self.fair, clock)
        # Swapped requests come back in the same order the waiting ones are admitted in.
        self.swapped = make_request_queue(config.policy, config.aging_seconds, self.fair, clock)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_preemptions_by_kind = {"recompute": 0, "swap": 0}
        self.swapped_out_bytes = 0
        self.swapped_in_bytes = 0
        self.num_chunked_prefills = 0  # scheduled slices shorter than what the request lacked
        self.total_queue_time = 0.0  # arrival to first scheduling, summed over requests
        self.num_queue_times = 0
        self.generation_rate = TokenRate()
        # The latest step's output; None while a step is being scheduled, so that a scheduler
        # that raises is never blamed on the step before.
        self.last_output: SchedulerOutput | None = None

    def add_request(self, request: Request) -> None:
        """Queue a new request."""
        self.requests[request.request_id] = request
        self.fair.activate(request)
        self.waiting.add(request)

    def _preempt_key(self, request: Request) -> tuple[float, float, float]:
        # The largest key is preempted first: the latest arrival, or by policy the least urgent
        # (then, for "fair", the request of the tenant furthest ahead of its share).
        if self.config.policy == "priority":
            return (request.priority, 0.0, request.arrival_time)
        if self.config.policy == "fair":
            vft = self.fair.virtual_finish_time(request)
            return (request.priority, vft, request.arrival_time)
        return (0, 0.0, request.arrival_time)

    def preemption_kind(self, request: Request) -> str:
        """ "swap" or "recompute" for this victim, from the estimated cost of each."""
        if self.swap_space is None or self.cost_model is None or not request.num_computed_tokens:
            return "recompute"
        num_blocks = self.kv_cache_manager.num_computed_blocks(request)
        if num_blocks > self.swap_space.num_free_blocks:
            return "recompute"
        num_bytes = num_blocks * self.swap_space.bytes_per_block
        return self.cost_model.choose(num_bytes, request.num_computed_tokens)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        kind = self.preemption_kind(request)
        kv = self.kv_cache_manager
        if kind == "swap":
            block_ids = kv.computed_block_ids(request)
            # The copy runs now, before this step's forward can overwrite the freed blocks.
            self.swapped_out_bytes += self.swap_space.swap_out(request.request_id, block_ids)
            kv.free(request)
            request.status = RequestStatus.SWAPPED
            self.swapped.readd_preempted(request)
            out.swapped_out_ids.append(request.request_id)
        else:
            self.restart(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_kind[kind] += 1
        out.preempted_ids.append(request.request_id)

    def restart(self, request: Request) -> None:
        """Drop a request's KV (in blocks or in the swap pool) and queue it to be recomputed."""
        if request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.swap_space.free(request.request_id)
        else:
            self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.readd_preempted(request)

    def preempt_all(self) -> None:
        """Recompute every running and swapped request, and forget the prefix cache's free
        blocks (a step that raised may have published blocks whose KV it never wrote)."""
        # Reversed, so that the FCFS queue gets them back in their order.
        for request in reversed(list(self.running)):
            self.running.remove(request)
            self.restart(request)
        for request in list(self.swapped):
            self.restart(request)
        self.kv_cache_manager.block_pool.reset_prefix_cache()

    def hold_all_but(self, parent_ids: set[str]) -> list[Request]:
        """Take every request of other parents out of scheduling (running ones recompute);
        returns the waiting ones taken out, to give back with `unhold`."""
        for request in reversed(list(self.running)):
            if request.parent_id not in parent_ids:
                self.running.remove(request)
                self.restart(request)
        held = [r for r in self.waiting if r.parent_id not in parent_ids]
        for request in held:
            self.waiting.remove(request)
        return held

    def unhold(self, request: Request) -> None:
        """Give back a request taken out by `hold_all_but`."""
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.readd_preempted(request)

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        num_new = min(request.num_tokens - num_computed, token_budget)
        num_new = self.kv_cache_manager.cap_at_state_snapshot(request, num_computed, num_new)
        if num_new < request.num_tokens - num_computed:
            self.num_chunked_prefills += 1
        return num_new

    def _allocate(
        self, request: Request, num_computed: int, num_new: int, computed_blocks=None
    ) -> int | None:
        """Slots for ``num_new`` more tokens of ``request``, or for a smaller chunk: where a
        window gives its blocks back as a prefill moves on, a pool too small for the rest of a
        prompt at once holds it chunk by chunk (the whole would wait, or preempt itself,
        forever). The tokens given slots, or None."""
        kv, remaining = self.kv_cache_manager, request.num_tokens - num_computed
        asked, bs = num_new, kv.block_size
        while kv.allocate_slots(request, num_new, computed_blocks) is None:
            if not (self.config.enable_chunked_prefill and kv.has_windows and num_new > bs):
                return None
            num_new = max(bs, num_new // 2 // bs * bs)
        if asked == remaining and num_new < remaining:  # a whole prefill became a chunk
            self.num_chunked_prefills += 1
        return num_new

    def schedule(self) -> SchedulerOutput:
        """Build the next step: running requests first, then waiting ones while blocks allow."""
        cfg = self.config
        self.last_output = None
        out = SchedulerOutput()
        token_budget = cfg.max_num_batched_tokens
        kv = self.kv_cache_manager

        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, token_budget)
            assert num_new > 0, request
            while (fitted := self._allocate(request, request.num_computed_tokens, num_new)) is None:
                # Only requests not yet scheduled this step are candidates, so no block that
                # this step will write is ever freed under it.
                victim = max(self.running[i:], key=self._preempt_key)
                self.running.remove(victim)
                self._preempt(victim, out)
                if victim is request:
                    break
            num_new = fitted or num_new
            if request.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(
                ScheduledRequest(request, num_new, kv.get_block_ids(request.request_id))
            )
            token_budget -= num_new
            i += 1

        # A step that had to preempt admits nothing: the pool is known to be short.
        while (
            not out.preempted_ids
            and self.swapped
            and token_budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            request = self.swapped.peek()
            num_new = self._num_new_tokens(request, request.num_computed_tokens, token_budget)
            num_new = self._allocate(request, request.num_computed_tokens, num_new)
            if num_new is None:
                break
            self.swapped.pop()
            block_ids = kv.get_block_ids(request.request_id)
            self.swapped_in_bytes += self.swap_space.swap_in(
                request.request_id, kv.computed_block_ids(request)
            )
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.swapped_in_ids.append(request.request_id)
            out.scheduled.append(ScheduledRequest(request, num_new, block_ids))
            token_budget -= num_new

        # Swapped requests go back in before any new work is admitted.
        while (
            not out.preempted_ids
            and not self.swapped
            and self.waiting
            and token_budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            request = self.waiting.peek()
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            if request.pooling is not None and request.pooling.params.needs_every_token:
                # Mean/CLS pool states a hit would skip: no group takes cached blocks.
                computed_blocks, num_computed = [[] for _ in computed_blocks], 0
            if request.num_tokens - num_computed > token_budget and not cfg.enable_chunked_prefill:
                break
            num_new = self._num_new_tokens(request, num_computed, token_budget)
            num_new = self._allocate(request, num_computed, num_new, computed_blocks)
            if num_new is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
                self.total_queue_time += request.first_scheduled_time - request.arrival_time
                self.num_queue_times += 1
            self.running.append(request)
            out.scheduled.append(
                ScheduledRequest(request, num_new, kv.get_block_ids(request.request_id))
            )
            token_budget -= num_new

        assert token_budget >= 0
        assert len(self.running) <= cfg.max_num_seqs
        out.total_num_scheduled_tokens = cfg.max_num_batched_tokens - token_budget
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        out.num_prefill_tokens = sum(
            s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1
        )
        self.last_output = out
        return out

    def update_after_step(
        self, out: SchedulerOutput, sampled_rows: Mapping[int, object], seconds: float
    ) -> None:
        """Charge tenants for the step's tokens, count samples, time the prefill speed."""
        for s in out.scheduled:
            self.fair.charge(s.request, s.num_new_tokens)
        for row in sampled_rows:
            self.fair.count_generated(out.scheduled[row].request)
        self.generation_rate.record(len(sampled_rows), self.clock())
        if out.num_prefill_tokens and self.cost_model is not None:
            self.cost_model.observe_prefill(out.total_num_scheduled_tokens, seconds)

    @property
    def mean_queue_time(self) -> float:
        """Mean seconds from arrival to first scheduling, over requests scheduled so far."""
        return self.total_queue_time / self.num_queue_times if self.num_queue_times else 0.0

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` and free its blocks at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.swap_space.free(request.request_id)
        elif not request.status.finished:
            self.waiting.remove(request)
        if not request.status.finished:
            self.kv_cache_manager.free(request)
            self.fair.deactivate(request)
        request.status = status
        request.finished_time = self.clock()
        self.requests.pop(request.request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted; returns it, or None if it is unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return bool(self.running) or bool(self.waiting) or bool(self.swapped)

    @property
    def num_waiting(self) -> int:
        """Requests not running: not admitted yet, preempted, or swapped out."""
        return len(self.waiting) + len(self.swapped)

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is in the swap pool now."""
        return len(self.swapped)

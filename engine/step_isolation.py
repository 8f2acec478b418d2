"""Step isolation: a step that raises is rolled back and its culprit found by bisection.

A request whose data makes the model or the sampler raise would otherwise take the whole
batch (and, in a worker, the process) down with it, and again on every worker that retries
it. Instead, the failed step is rolled back (every running request preempted, the prefix
cache's free blocks forgotten, since the step may have published blocks whose KV it never
wrote), and the requests of that step are run again in halves, each half alone, until the
step's work has been redone; a half that raises is split again, down to one request, which is
ended ("abort") with the error. Innocent requests are only recomputed: greedy outputs are
unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput

# A round that finds no culprit (the fault did not come back with the halves alone) ends;
# after this many such rounds in a row, every request of the failing step is failed.
MAX_INCONCLUSIVE_ROUNDS = 3


class StepIsolation:
    """Runs `LLMEngine._step` and, after a failure, the bisection rounds that follow it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.probe: list[str] = []  # parent ids that run alone right now
        self.stack: list[list[str]] = []  # groups still to probe in this round
        self.targets: dict[str, int] = {}  # child id -> num_computed_tokens to reach
        self.held: list[Request] = []
        self.error = ""
        self.inconclusive_rounds = 0

    @property
    def active(self) -> bool:
        """True while a bisection round runs (only the probe group is scheduled)."""
        return bool(self.probe)

    def step(self) -> list[RequestOutput]:
        """One engine step, isolated."""
        if self.active:
            self._hold_all_but_probe()
        try:
            outputs = self.engine._step()
        except Exception as exc:  # noqa: BLE001 - any error of a step is some request's doing
            return self._on_failure(exc)
        if self.active and self._probe_done():
            self._next_probe()
        return outputs

    def forget(self, request: Request) -> None:
        """Put a held request back into the waiting queue (before it is aborted)."""
        if request in self.held:
            self.held.remove(request)
            self.engine.scheduler.waiting.readd_preempted(request)

    # --- failure ----------------------------------------------------------------------------
    def _on_failure(self, exc: Exception) -> list[RequestOutput]:
        engine = self.engine
        sched_out = engine.last_scheduler_output
        scheduled = list(sched_out.scheduled) if sched_out is not None else []
        parents = list(dict.fromkeys(s.request.parent_id for s in scheduled))
        parents = [p for p in parents if p in engine.parents]
        if not parents:
            raise exc
        for s in scheduled:
            target = s.request.num_computed_tokens + s.num_new_tokens
            self.targets[s.request.request_id] = target
        self._rollback()
        self.error = f"{type(exc).__name__}: {exc}"
        if len(parents) == 1:
            return self._found(parents[0])
        if not self.active and self.inconclusive_rounds >= MAX_INCONCLUSIVE_ROUNDS:
            outputs = [self._fail(p) for p in parents]
            self._end_round()
            return outputs
        half = len(parents) // 2
        self.stack = [parents[half:], parents[:half]]
        self._next_probe()
        return []

    def _found(self, parent_id: str) -> list[RequestOutput]:
        output = self._fail(parent_id)
        self.inconclusive_rounds = 0
        self._end_round()
        return [output]

    def _fail(self, parent_id: str) -> RequestOutput:
        engine = self.engine
        parent = engine.parents[parent_id]
        for child in parent.children:
            if not child.status.finished:
                self.forget(child)
                engine.scheduler.abort_request(child.request_id)
        engine._faulty.discard(parent_id)
        engine.failed_requests.append((parent_id, self.error))
        return engine._make_output(parent)

    def _rollback(self) -> None:
        scheduler = self.engine.scheduler
        # Reversed, so that the FCFS queue gets them back in their order.
        for request in reversed(list(scheduler.running)):
            scheduler.running.remove(request)
            scheduler.restart(request)
        # Swapped requests recompute too: the isolation rounds then only see waiting ones.
        for request in list(scheduler.swapped):
            scheduler.restart(request)
        self.engine.kv_cache_manager.block_pool.reset_prefix_cache()

    # --- probing ----------------------------------------------------------------------------
    def _next_probe(self) -> None:
        while self.stack:
            group = [p for p in self.stack.pop() if p in self.engine.parents]
            if group:
                self.probe = group
                return
        # Every group redid its work without raising: the fault did not come back.
        self.inconclusive_rounds += 1
        self._end_round()

    def _probe_done(self) -> bool:
        for parent_id in self.probe:
            parent = self.engine.parents.get(parent_id)
            for child in parent.children if parent else []:
                target = self.targets.get(child.request_id, 1)
                if not child.status.finished and child.num_computed_tokens < target:
                    return False
        return True

    def _hold_all_but_probe(self) -> None:
        scheduler = self.engine.scheduler
        probe = set(self.probe)
        for request in reversed(list(scheduler.running)):
            if request.parent_id not in probe:
                scheduler.running.remove(request)
                scheduler.restart(request)
        for request in list(scheduler.waiting):
            if request.parent_id not in probe:
                scheduler.waiting.remove(request)
                self.held.append(request)
        # A probe member held by an earlier probe goes back to the queue.
        for request in [r for r in self.held if r.parent_id in probe]:
            self.forget(request)

    def _end_round(self) -> None:
        waiting = self.engine.scheduler.waiting
        for request in reversed(self.held):
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                waiting.readd_preempted(request)
        self.held.clear()
        self.probe, self.stack = [], []
        self.targets.clear()

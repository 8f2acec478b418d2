"""Step isolation: a step that raises is rolled back and its culprit found by bisection.

A request whose data makes the model or the sampler raise would otherwise take the whole
batch (and, in a worker, the process) down with it, and again on every worker that retries
it. Instead, the failed step is rolled back (every running request preempted, the prefix
cache's free blocks forgotten, since the step may have published blocks whose KV it never
wrote), and the requests of that step are run again in halves, each half alone, until the
step's work has been redone; a half that raises is split again, down to one request, which is
ended ("abort") with the error. Innocent requests are only recomputed: greedy outputs are
unchanged.

It depends on the scheduler's public methods and on three callables of its engine: run one
step, the samples of a request, and fail a request.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.outputs import RequestOutput
from engine.parallel.ranks import RankFailure
from engine.request import Request
from engine.scheduler import Scheduler

# A round that finds no culprit (the fault did not come back with the halves alone) ends;
# after this many such rounds in a row, every request of the failing step is failed.
MAX_INCONCLUSIVE_ROUNDS = 3


class StepIsolation:
    """Runs steps and, after a failure, the bisection rounds that follow it.

    `run_step()` runs one raw step; `children(parent_id)` gives a request's samples (None once
    it ended); `fail(parent_id, error)` ends a request and returns its final output.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        run_step: Callable[[], list[RequestOutput]],
        children: Callable[[str], list[Request] | None],
        fail: Callable[[str, str], RequestOutput],
    ) -> None:
        self.scheduler = scheduler
        self.run_step = run_step
        self.children = children
        self.fail = fail
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
            outputs = self.run_step()
        except RankFailure:
            raise  # the engine itself failed: no request to blame
        except Exception as exc:  # noqa: BLE001 - any error of a step is some request's doing
            return self._on_failure(exc)
        if self.active and self._probe_done():
            self._next_probe()
        return outputs

    def forget(self, request: Request) -> None:
        """Put a held request back into the waiting queue (before it is aborted)."""
        if request in self.held:
            self.held.remove(request)
            self.scheduler.unhold(request)

    # --- failure ----------------------------------------------------------------------------
    def _on_failure(self, exc: Exception) -> list[RequestOutput]:
        sched_out = self.scheduler.last_output
        scheduled = list(sched_out.scheduled) if sched_out is not None else []
        parents = list(dict.fromkeys(s.request.parent_id for s in scheduled))
        parents = [p for p in parents if self.children(p) is not None]
        if not parents:
            raise exc
        for s in scheduled:
            target = s.request.num_computed_tokens + s.num_new_tokens
            self.targets[s.request.request_id] = target
        self.scheduler.preempt_all()
        self.error = f"{type(exc).__name__}: {exc}"
        if len(parents) == 1:
            output = self.fail(parents[0], self.error)
            self.inconclusive_rounds = 0
            self._end_round()
            return [output]
        if not self.active and self.inconclusive_rounds >= MAX_INCONCLUSIVE_ROUNDS:
            outputs = [self.fail(p, self.error) for p in parents]
            self._end_round()
            return outputs
        half = len(parents) // 2
        self.stack = [parents[half:], parents[:half]]
        self._next_probe()
        return []

    # --- probing ----------------------------------------------------------------------------
    def _next_probe(self) -> None:
        while self.stack:
            group = [p for p in self.stack.pop() if self.children(p) is not None]
            if group:
                self.probe = group
                return
        # Every group redid its work without raising: the fault did not come back.
        self.inconclusive_rounds += 1
        self._end_round()

    def _probe_done(self) -> bool:
        for parent_id in self.probe:
            for child in self.children(parent_id) or []:
                target = self.targets.get(child.request_id, 1)
                if not child.status.finished and child.num_computed_tokens < target:
                    return False
        return True

    def _hold_all_but_probe(self) -> None:
        probe = set(self.probe)
        self.held += self.scheduler.hold_all_but(probe)
        # A probe member held by an earlier probe goes back to the queue.
        for request in [r for r in self.held if r.parent_id in probe]:
            self.forget(request)

    def _end_round(self) -> None:
        for request in reversed(self.held):
            self.scheduler.unhold(request)
        self.held.clear()
        self.probe, self.stack = [], []
        self.targets.clear()

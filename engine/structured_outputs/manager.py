"""The engine's side of structured outputs: compile, hold until compiled, mask, advance."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.request import Request, RequestStatus
from engine.structured_outputs.bitmask import GrammarBitmask
from engine.structured_outputs.compiler import GrammarCompiler, timeout_error
from engine.structured_outputs.grammar import GrammarError, check_cheaply
from engine.structured_outputs.matcher import StructuredOutputRequest
from engine.structured_outputs.params import StructuredOutputsParams

# With nothing to run but grammars compiling, a step waits this long for one (not spinning
# on a core the compile needs).
IDLE_WAIT_S = 0.05


@dataclass(slots=True)
class PendingMask:
    """A step's bitmask being filled: the sampled rows it covers and the fill in flight."""

    rows: list[int]
    requests: list[StructuredOutputRequest]
    fill: object


class StructuredOutputManager:
    """Holds each constrained request until its grammar compiled, then masks its logits and
    advances its matcher every step; appends the tokens the grammar forces."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_compile_s: float
    ) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.max_compile_s = max_compile_s
        self.held: list[Request] = []  # waiting for their grammar, not in the scheduler yet
        self.live: set[Request] = set()  # compiled and not finished: the rows to mask
        self._bitmask: GrammarBitmask | None = None
        # Tests switch these off to show the output does not depend on them.
        self.enable_fast_forward = True
        self.num_constrained_tokens = 0
        self.num_forced_tokens = 0
        self.num_failed = 0

    # --- admission --------------------------------------------------------------------------
    def check(self, params: StructuredOutputsParams) -> None:
        """Refuse a constraint known to be bad, where that is cheap (GrammarError)."""
        future = self.compiler.cached(params)
        if future is None:
            check_cheaply(params)
        elif future.done() and future.exception() is not None:
            raise future.exception()

    def hold(self, request: Request) -> bool:
        """Start compiling a constrained request's grammar and keep it until that is done;
        False (nothing held) for an unconstrained one."""
        params = request.params.structured_outputs
        if params is None:
            return False
        grammar = self.compiler.submit(params)
        request.structured_output_request = StructuredOutputRequest(params, grammar)
        self.held.append(request)
        return True

    def release(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is ready, (request, error) of those whose compile failed or
        ran over max_grammar_compile_s); both leave the held list."""
        ready, failed, still = [], [], []
        for request in self.held:
            so = request.structured_output_request
            if so.grammar.done():
                error = so.grammar.exception()
                if error is None and so.grammar.result().seconds > self.max_compile_s:
                    # Done between two checks, but over the limit all the same.
                    error = timeout_error(so.params, self.max_compile_s)
                    self.compiler.expire(so.params, error)
                if error is not None:
                    failed.append((request, str(error)))
                    continue
                so.matcher = so.grammar.result().new_matcher()
                self.live.add(request)
                ready.append(request)
            elif self.compiler.seconds_compiling(so.params) > self.max_compile_s:
                error = timeout_error(so.params, self.max_compile_s)
                self.compiler.expire(so.params, error)
                failed.append((request, str(error)))
            else:
                still.append(request)
        self.held = still
        self.num_failed += len({r.parent_id for r, _ in failed})
        return ready, failed

    def wait(self) -> None:
        """Block until a held request's compile ends, or IDLE_WAIT_S passes."""
        futures = [r.structured_output_request.grammar for r in self.held]
        if futures:
            concurrent.futures.wait(
                futures, IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def forget(self, request: Request) -> bool:
        """Drop a request that ends (aborted); True if it was still held here."""
        self.live.discard(request)
        if request in self.held:
            self.held.remove(request)
            return True
        return False

    @property
    def num_held(self) -> int:
        """Requests waiting for their grammar."""
        return len(self.held)

    # --- each step --------------------------------------------------------------------------
    def start_bitmask(self, requests: list[Request]) -> PendingMask | None:
        """Begin the mask of this step's sampled rows (``requests``); None when none is
        constrained, so an unconstrained batch pays one empty-set test."""
        if not self.live:
            return None
        self.live = {r for r in self.live if not r.status.finished}
        rows, states = [], []
        for i, r in enumerate(requests):
            so = r.structured_output_request
            if so is not None and so.matcher is not None:
                rows.append(i)
                states.append(so)
        if not rows:
            return None
        if self._bitmask is None:
            self._bitmask = GrammarBitmask(self.compiler.ll_tokenizer().vocab_size)
        return PendingMask(rows, states, self._bitmask.start([s.matcher for s in states]))

    def apply_bitmask(self, logits: torch.Tensor, pending: PendingMask) -> None:
        """Forbid, in place, every token the grammars do not allow next."""
        mask = self._bitmask.finish(pending.fill)
        self._bitmask.apply(logits, pending.rows, mask)
        for so in pending.requests:
            so.num_constrained_tokens += 1
        self.num_constrained_tokens += len(pending.rows)

    def advance(
        self,
        request: Request,
        token_id: int,
        append_forced: Callable[[int], RequestStatus | None],
    ) -> tuple[RequestStatus | None, str | None]:
        """Feed the sampled token to the matcher, then append (with ``append_forced``, which
        returns a finish status or None) what the grammar forces next.

        Returns (status, error): "stop" once the grammar is complete; an error (the request
        fails) if the matcher refused a token.
        """
        so = request.structured_output_request
        if not so.accept(token_id):
            return RequestStatus.FINISHED_ABORTED, self._refused(so, token_id)
        while not so.is_finished:
            forced = so.forced_tokens() if self.enable_fast_forward else []
            if not forced:
                return None, None
            for forced_id in forced:
                if not so.accept(forced_id):
                    return RequestStatus.FINISHED_ABORTED, self._refused(so, forced_id)
                so.num_forced_tokens += 1
                self.num_forced_tokens += 1
                status = append_forced(forced_id)
                if status is not None:
                    return status, None
                if so.is_finished:
                    break
        return RequestStatus.FINISHED_STOPPED, None

    @staticmethod
    def _refused(so: StructuredOutputRequest, token_id: int) -> str:
        error = GrammarError(so.params.kind, f"the grammar refused token {token_id}: {so.error}")
        return str(error)

    def shutdown(self) -> None:
        """Stop the compile threads."""
        self.compiler.shutdown()

"""Grammars compile on a small thread pool, once per (kind, spec digest), off the step path."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass

import llguidance.hf
from llguidance import LLMatcher, LLTokenizer

from engine.structured_outputs.grammar import GrammarError, check, grammar_text
from engine.structured_outputs.params import StructuredOutputsParams

# Two threads: one pathological grammar (llguidance bounds each by its fuel limits, but that
# can still take seconds) does not hold up every other request's grammar.
NUM_COMPILE_THREADS = 2
# Compiled grammars kept: a dataset job may bring a schema per row.
MAX_CACHED_GRAMMARS = 512


@dataclass(slots=True)
class CompiledGrammar:
    """A checked grammar and a matcher in its start state; each sample gets a copy."""

    grammar: str
    template: LLMatcher
    seconds: float  # how long the compile took

    def new_matcher(self) -> LLMatcher:
        """A fresh matcher for one sample (a copy costs microseconds, a new one milliseconds)."""
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; the futures are cached by ``params.key``."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._started: dict[tuple[str, str], float] = {}  # key -> perf_counter at compile start
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.num_cache_hits = 0

    def ll_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the tokenizer, built once (about a second), on first use."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                vocab = max(self._vocab_size, len(self._hf_tokenizer))
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=vocab, eos_token=self._eos_token_ids
                )
            return self._ll_tokenizer

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The future CompiledGrammar of ``params`` (GrammarError if it does not compile)."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, "pagedq-grammar")
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                old_key, _ = self._cache.popitem(last=False)
                self._started.pop(old_key, None)
            return future

    def cached(self, params: StructuredOutputsParams) -> Future | None:
        """The compile of ``params`` if one was submitted (and is still cached)."""
        return self._cache.get(params.key)

    def seconds_compiling(self, params: StructuredOutputsParams) -> float:
        """How long the compile of ``params`` has run (0 while it waits for a thread)."""
        started = self._started.get(params.key)
        return 0.0 if started is None else time.perf_counter() - started

    def expire(self, params: StructuredOutputsParams, error: GrammarError) -> None:
        """Make ``params`` fail fast from now on (its compile ran over the limit)."""
        failed: Future = Future()
        failed.set_exception(error)
        with self._lock:
            self._cache[params.key] = failed
            self._started.pop(params.key, None)

    def compile_now(self, params: StructuredOutputsParams, timeout_s: float) -> CompiledGrammar:
        """Compile and wait (the offline API checks before it queues anything)."""
        future = self.submit(params)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeoutError:
            error = timeout_error(params, timeout_s)
            self.expire(params, error)
            raise error from None

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        start = time.perf_counter()
        self._started[params.key] = start
        try:
            try:
                tokenizer = self.ll_tokenizer()
            except Exception as e:  # noqa: BLE001 - e.g. a slow (Python) tokenizer
                raise GrammarError(params.kind, f"llguidance cannot use this tokenizer: {e}") from e
            grammar = grammar_text(params)
            check(params, grammar, tokenizer)
            template = LLMatcher(tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(params.kind, template.get_error())
            return CompiledGrammar(grammar, template, time.perf_counter() - start)
        finally:
            with self._lock:
                self.num_compiles += 1
                self.compile_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        """Stop the pool's threads (compiles in flight are left to finish)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def timeout_error(params: StructuredOutputsParams, limit_s: float) -> GrammarError:
    """The error of a compile that ran over ``max_grammar_compile_s``."""
    return GrammarError(
        params.kind, f"the grammar did not compile within max_grammar_compile_s={limit_s:g} s"
    )

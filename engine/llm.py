"""The offline API: ``LLM(model).generate(prompts, params)``, after vLLM's."""

from __future__ import annotations

import atexit
import itertools
import time
import weakref
from collections.abc import Sequence

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import EmbeddingRequestOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate for many prompts at once with continuous batching; outputs in input order."""

    def __init__(self, model: str = "smollm2", **kwargs) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        if self.llm_engine.ranks is not None:
            # The other ranks go with this process; stopped first, they leave the group
            # cleanly. A weak reference: the exit hook must not keep the engine (its KV
            # cache) alive after the LLM is dropped.
            atexit.register(_shutdown, weakref.ref(self.llm_engine))
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at one rank); idempotent."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        """The Hugging Face tokenizer in use."""
        return self.llm_engine.tokenizer

    @property
    def stats(self) -> EngineStats:
        """Steps, preemptions, prefix-cache hit rate, KV usage and token counts."""
        return self.llm_engine.get_stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        tenant: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (a string or a list of token ids).

        ``priority`` and ``tenant``: one per prompt (see the "priority" and "fair" policies).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, priority, tenant)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete one conversation or a list of them, with the model's chat template."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = []
        for i, conversation in enumerate(messages):
            try:
                prompts.append(self.llm_engine.prompts.apply_chat_template(list(conversation)))
            except ValueError as e:
                raise ValueError(f"messages[{i}]: {e}") from e
        return self._run(prompts, sampling_params, use_tqdm, None, None)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str | None = None,
        normalize: bool = True,
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (``outputs[0].embedding``), in input order.

        ``pooling``: "last", "mean" or "cls"; None takes the checkpoint's own (its
        sentence-transformers pooling config, else "last"). The prompts join the running batch
        like any request, stop after their prefill and never sample.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        params = PoolingParams(pooling, normalize, dimensions)
        engine = self.llm_engine
        processed = []
        for i, prompt in enumerate(prompts):
            try:
                processed.append(engine.prompts.process(prompt))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
        ids = [str(next(self._counter)) for _ in processed]
        for request_id, prompt in zip(ids, processed):
            engine.add_embedding_request(request_id, [prompt], params)
        return self._run_engine(ids, use_tqdm)

    def _run(self, prompts, sampling_params, use_tqdm, priority, tenant) -> list[RequestOutput]:
        engine = self.llm_engine
        params = self._params_list(sampling_params, len(prompts))
        for name, values in (("priority", priority), ("tenant", tenant)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(
                    f"{name} has {len(values)} entries: must be one per prompt ({len(prompts)})"
                )
        # Validate everything before queueing anything: a bad prompt leaves the engine untouched.
        processed = []
        for i, prompt in enumerate(prompts):
            try:
                processed.append(engine.prompts.process(prompt))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
        self._compile_grammars(params)
        ids = [str(next(self._counter)) for _ in prompts]
        for i, (request_id, prompt) in enumerate(zip(ids, processed)):
            engine.add_request(
                request_id,
                prompt,
                params[i],
                priority=priority[i] if priority else 0,
                tenant=tenant[i] if tenant else None,
            )
        return self._run_engine(ids, use_tqdm)

    def _compile_grammars(self, params: list[SamplingParams]) -> None:
        # Each distinct grammar compiles (cached) before anything is queued: a bad one raises
        # here, like a bad prompt, and the engine stays clean.
        engine, seen = self.llm_engine, set()
        for i, p in enumerate(params):
            so = p.structured_outputs
            if so is None or so.key in seen:
                continue
            seen.add(so.key)
            try:
                engine.structured.compiler.compile_now(so, engine.config.max_grammar_compile_s)
            except ValueError as e:
                raise ValueError(f"sampling_params[{i}]: {e}") from e

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(
                f"sampling_params has {len(params)} entries: must be one, or one per prompt ({n})"
            )
        return params

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        start, tokens_start = time.time(), engine.num_generated_tokens
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                elapsed = max(time.time() - start, 1e-9)
                bar.set_postfix(
                    tok_s=f"{(engine.num_generated_tokens - tokens_start) / elapsed:.0f}",
                    refresh=False,
                )
        finally:
            bar.close()
            for rid in ids:
                if rid not in done:
                    engine.abort_request(rid)
        return [done[rid] for rid in ids]


def _shutdown(engine_ref: weakref.ref) -> None:
    engine = engine_ref()
    if engine is not None:
        engine.shutdown()

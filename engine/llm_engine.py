"""LLMEngine: requests in, one scheduler step at a time, outputs out. Knows nothing of Redis."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.chunked_local_attention import check_model_chunks
from engine.config import (
    EngineConfig,
    parse_memory,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from engine.cpu_threads import apply_num_threads, default_num_threads
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_spec import LatentAttentionSpec, TokenBlocksSpec, make_layout
from engine.model_loader import cached_source, load_model, resolve_model
from engine.model_runner import ModelRunner
from engine.models import check_parallel
from engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from engine.parallel.cache_ops import CacheOpLog
from engine.parallel.plan import PlanChannel
from engine.parallel.ranks import RankFailure, RankGroup, check_rank_count, rank_device
from engine.parallel.state import min_over_ranks, set_moe_parallel, tp_rank, tp_size
from engine.pooling import PoolingParams, PoolingState, checkpoint_pooling
from engine.prompts import ProcessedPrompt, Prompt, PromptProcessor
from engine.request import FINISH_REASONS, Request, RequestStatus
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.state_cache import StateCache, state_bytes_per_slot
from engine.step_isolation import StepIsolation
from engine.structured_outputs.manager import StructuredOutputManager
from engine.swap import INITIAL_PREFILL_TOKENS_PER_S, PreemptionCostModel, SwapSpace
from kernels import allocate_kv_cache
from kernels.mla import allocate_latent_cache

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
# Test-only fault injection: with PAGEDQ_TEST_FAULTS=1 in the environment when the engine is
# built, a request whose prompt contains FAULT_MARKER raises inside every step it is part of.
FAULT_ENV = "PAGEDQ_TEST_FAULTS"
FAULT_MARKER = "<<pagedq-test-fault>>"


class InjectedFault(RuntimeError):
    """The test-only fault (see FAULT_ENV)."""


@dataclass(slots=True)
class EngineStats:
    """Counters an operator or a test reads."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_chunked_prefills: int
    prefix_cache_hit_rate: float
    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Scheduling (issue 9): preemptions by kind, swap, tenants, queue time, throughput.
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_swapped: int = 0  # requests in the swap pool now
    swapped_out_bytes: int = 0  # since start
    swap_space_usage: float = 0.0  # fraction of the swap pool held
    # (kind, blocks held) of each KV layer group: "full_attention", "sliding_window=W",
    # "latent_attention"
    kv_blocks_by_group: list[tuple[str, int]] = field(default_factory=list)
    tenant_generated_tokens: dict[str, int] = field(default_factory=dict)
    mean_queue_time_s: float = 0.0  # arrival in the engine to first scheduling
    num_scheduled_requests: int = 0  # requests scheduled at least once (queue-time samples)
    generation_tokens_per_s: float = 0.0  # over the last 10 s
    prefill_tokens_per_s: float = 0.0  # the moving average the swap/recompute rule uses
    copy_bytes_per_s: float = 0.0  # measured at start (0 without a swap pool)
    num_scheduled_tokens: int = 0  # tokens the latest step computed (prefill chunks + decodes)
    # Structured outputs (issue 24): grammar compiles, and the tokens grammars decided.
    num_grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0  # summed over compiles (on the compile threads)
    grammar_cache_hits: int = 0
    num_waiting_for_grammar: int = 0  # requests whose grammar is still compiling
    num_grammar_failures: int = 0  # requests failed by their grammar (bad, too slow, refused)
    num_constrained_tokens: int = 0  # sampled under a grammar's mask
    num_forced_tokens: int = 0  # appended by a grammar without a decode step


class _ParentRequest:
    """The user's request: its ``n`` samples and their detokenizers."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "children", "detokenizers")

    def __init__(self, request_id, prompt, prompt_token_ids, children, detokenizers):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children: list[Request] = children
        self.detokenizers: list[IncrementalDetokenizer] = detokenizers


class LLMEngine:
    """Continuous batching over a paged KV cache for one Llama-family model."""

    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        config = config or EngineConfig(**kwargs)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        tp = config.tensor_parallel_size
        threads = config.num_threads or (max(1, default_num_threads() // tp) if tp > 1 else None)
        self.num_threads = apply_num_threads(threads, self.device)
        self.model_name = config.model
        self.ranks, self.plan_channel = None, None
        if tp > 1:
            check_parallel(config.model, config.model_impl, tp)  # before any rank starts
            self._join_ranks(config, threads)
        set_moe_parallel(config.moe_parallel)
        self.model, self.hf_config, self.tokenizer = load_model(
            config.model, self.dtype, self.device, config.attention_backend, tp,
            config.moe_parallel, config.model_impl,
        )  # fmt: skip
        max_position = self.model.max_position
        check_model_chunks(self.model, config.block_size)
        self.kv_layout = make_layout(self.model.kv_cache_specs())
        self.state_specs = getattr(self.model, "recurrent_state_specs", list)()

        num_blocks = self._num_kv_blocks()
        self.state_cache = self._make_state_cache()
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.kv_layout.groups,
            self.state_cache,
        )
        self.max_model_len = min(max_position, self._longest_fitting(num_blocks))
        if config.max_model_len is not None:
            if config.max_model_len > self.max_model_len:
                raise ValueError(
                    f"max_model_len={config.max_model_len} is invalid: must be <= "
                    f"{self.max_model_len} (model limit and KV cache of {num_blocks} blocks)"
                )
            self.max_model_len = config.max_model_len
        self.prompts = PromptProcessor(
            self.tokenizer, self.hf_config.vocab_size, self.max_model_len
        )
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.swap_space, self.cost_model = self._make_swap_space()
        if self.swap_space is not None:
            self.swap_space.state_cache = self.state_cache
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
                aging_seconds=config.priority_aging_seconds,
                tenant_weights=dict(config.tenant_weights),
            ),
            self.kv_cache_manager,
            self.swap_space,
            self.cost_model,
        )
        self.eos_token_ids = self._eos_token_ids()
        self.structured = StructuredOutputManager(
            self.tokenizer,
            self.hf_config.vocab_size,
            self.eos_token_ids,
            config.max_grammar_compile_s,
        )
        self.model_runner = ModelRunner(
            self.model,
            self.kv_caches,
            config.block_size,
            self.device,
            Sampler(self.device, config.seed, config.attention_backend),
            self.eos_token_ids,
            self.structured,
            [self.kv_layout.layer_group[c] for c in self.model.kv_cache_indices()],
            self.state_cache,
        )
        if self.plan_channel is not None and tp_rank() == 0:
            self.model_runner.plan_channel = self.plan_channel
            self.model_runner.op_log = op_log = CacheOpLog()
            for cache in (self.swap_space, self.state_cache):
                if cache is not None:
                    cache.op_log = op_log
        self.parents: dict[str, _ParentRequest] = {}
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        # Step isolation: a step that raises is retried without its culprit (step_isolation.py).
        self.isolate_failures = True
        self.failed_requests: list[tuple[str, str]] = []
        self.isolation = StepIsolation(
            self.scheduler, self._step, self._children, self._fail_parent
        )
        self._faults_enabled = os.environ.get(FAULT_ENV) == "1"
        self._faulty: set[str] = set()
        self._early_outputs: list[RequestOutput] = []  # ended before a step ran (grammar failed)
        self._checkpoint_pooling: str | None = None  # read at the first embedding request

    # --- set-up -------------------------------------------------------------------------
    def _join_ranks(self, config: EngineConfig, threads: int | None) -> None:
        """Tensor parallel: rank 0 starts the other ranks (engine/parallel/ranks.py), each
        with this config, its "auto" values resolved here once; every rank then opens the
        plan channel (a collective: in the same order on every rank)."""
        check_rank_count(config.tensor_parallel_size, self.device)
        if not dist.is_initialized():
            folder = cached_source(resolve_model(config.model)).folder
            follower = dataclasses.replace(
                config,
                model=folder,
                dtype=str(self.dtype).removeprefix("torch."),
                device=self.device.type,
                num_threads=threads,
            )
            self.ranks = RankGroup.start(follower, config.tensor_parallel_size)
        elif tp_size() != config.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size} differs from the "
                f"process group's {tp_size()} ranks"
            )
        self.device = torch.device(rank_device(self.device, tp_rank()))
        self.plan_channel = PlanChannel()

    @property
    def is_driver(self) -> bool:
        """True on rank 0 (the only rank at tensor_parallel_size=1): the rank that schedules
        and samples; the others ``follow``."""
        return self.plan_channel is None or tp_rank() == 0

    def follow(self) -> None:
        """A rank other than 0: run rank 0's step plans on this rank's shard until it stops."""
        self.model_runner.follow(self.plan_channel, self.swap_space, self.state_cache)

    def check_ranks(self) -> None:
        """Raise ``RankFailure`` when another tensor-parallel rank has exited (rank 0)."""
        if self.ranks is not None:
            self.ranks.check(self.plan_channel)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their group (rank 0; idempotent).
        Nothing to do at one rank."""
        if self.ranks is not None:
            self.ranks.shutdown(self.plan_channel)

    def _kv_bytes_per_block(self) -> int:
        kv_dtype = resolve_kv_cache_dtype(self.config.kv_cache_dtype, self.dtype)
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        return self.config.block_size * self.kv_layout.block_elems * elem

    def _longest_fitting(self, num_blocks: int) -> int:
        """The longest sequence whose blocks, over every layer group, fit the pool."""
        kv, bs = self.kv_cache_manager, self.config.block_size
        usable = kv.num_free_blocks
        lo, hi = 0, num_blocks * bs
        while lo < hi:  # num_blocks_for grows with the length: bisect
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if kv.num_blocks_for(mid) <= usable else (lo, mid - 1)
        return lo

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory is not None:
            budget = parse_memory(cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        if self.plan_channel is not None:  # every rank holds its part of every block
            budget = min_over_ranks(budget)
        budget -= self._num_state_slots(budget) * self._state_bytes_per_slot()
        num_blocks = budget // self._kv_bytes_per_block()
        if self._no_attention:
            # Blocks only count tokens here: enough for every sequence at the longest length.
            per_seq = -(-self.model.max_position // cfg.block_size)
            num_blocks = min(num_blocks, cfg.max_num_seqs * per_seq)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={cfg.kv_cache_memory!r} is too small: one block needs "
                f"{self._kv_bytes_per_block()} bytes"
            )
        return int(num_blocks)

    @property
    def _no_attention(self) -> bool:
        """True for a model whose block table only counts tokens (a pure Mamba-2 LM)."""
        return all(isinstance(g.spec, TokenBlocksSpec) for g in self.kv_layout.groups)

    def _state_bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.state_specs, self.dtype)

    def _num_state_slots(self, budget: int) -> int:
        """Recurrent-state slots taken from the KV budget: one per sequence up to
        ``max_num_seqs`` (at most half the budget, four fifths without attention layers), and a
        quarter as many prefix-cache snapshots (0 for a model without linear-attention layers)."""
        per_slot = self._state_bytes_per_slot()
        if not self.state_specs:
            return 0
        # Without attention layers the states are all the memory a sequence takes: the budget
        # holds the slots and their quarter of snapshots.
        share = budget * 4 // 5 if self._no_attention else budget // 2
        slots = max(1, min(self.config.max_num_seqs, share // per_slot))
        snapshots = max(1, slots // 4) if self.config.enable_prefix_caching else 0
        self.num_state_slots, self.num_state_snapshots = slots, snapshots
        return slots + snapshots

    def _make_state_cache(self) -> StateCache | None:
        if not self.state_specs:
            return None
        cache = StateCache(
            self.state_specs,
            self.num_state_slots,
            self.dtype,
            self.device,
            self.num_state_snapshots,
        )
        self.model.bind_state_cache(cache)
        return cache

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """Each layer's cache tensor: layers at the same place of their groups share one."""
        kv_dtype = resolve_kv_cache_dtype(self.config.kv_cache_dtype, self.dtype)
        self.kv_tensors = [
            self._allocate_tensor(spec, num_blocks, kv_dtype)
            for spec in self.kv_layout.tensor_specs
        ]
        # A layer that reads another's cache (Gemma 4) gets that layer's tensor.
        return [
            self.kv_tensors[self.kv_layout.layer_tensor[c]] for c in self.model.kv_cache_indices()
        ]

    def _allocate_tensor(self, spec, num_blocks: int, kv_dtype: torch.dtype) -> torch.Tensor:
        bs = self.config.block_size
        if isinstance(spec, (LatentAttentionSpec, TokenBlocksSpec)):
            return allocate_latent_cache(num_blocks, bs, spec.token_elems, kv_dtype, self.device)
        heads, head_dim = spec.page_shape
        backend = self.config.attention_backend
        return allocate_kv_cache(num_blocks, bs, heads, head_dim, kv_dtype, self.device, backend)

    def _make_swap_space(self) -> tuple[SwapSpace | None, PreemptionCostModel | None]:
        if not self.config.swap_space:
            return None, None
        swap = SwapSpace.from_budget(
            self.kv_tensors,
            int(self.config.swap_space * 2**30),
            [spec.block_dim for spec in self.kv_layout.tensor_specs],
        )
        if swap is None:
            return None, None
        initial = INITIAL_PREFILL_TOKENS_PER_S.get(self.device.type, 500.0)
        return swap, PreemptionCostModel(swap.measure_copy_bandwidth(), initial)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set(getattr(self.model, "generation_eos_token_ids", ()))
        for value in (getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return ids

    # --- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str | None = None,
    ) -> None:
        """Queue a prompt; raises ValueError (and adds nothing) on bad input.

        ``prompt``: a text, token ids, chat messages, or a prompt already processed by a
        `PromptProcessor` of this engine (`engine.prompts.copy()` on another thread).
        ``priority``: lower runs sooner (policies "priority" and "fair"). ``tenant``: the
        account the "fair" policy shares the engine between (None: the default account).
        """
        if request_id in self.parents:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} is invalid: must be an integer")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant={tenant!r} is invalid: must be a non-empty string or None")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        processed = self.prompts.process(prompt)
        text, token_ids = processed.text, processed.token_ids
        self._check_params(params, len(token_ids))
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)  # cheap; the compile runs apart
        arrival_time = time.time() if arrival_time is None else arrival_time
        children, detoks = [], []
        for k in range(params.n):
            child_params = params if params.n == 1 else params.clone_for_sample(k)
            child_id = request_id if params.n == 1 else f"{request_id}#{k}"
            children.append(
                Request(
                    child_id,
                    token_ids,
                    child_params,
                    text,
                    priority,
                    arrival_time,
                    request_id,
                    k,
                    tenant,
                )
            )
            detoks.append(
                IncrementalDetokenizer(
                    self.tokenizer, token_ids, params.stop_strings, params.skip_special_tokens
                )
            )
        self.parents[request_id] = _ParentRequest(request_id, text, token_ids, children, detoks)
        if self._faults_enabled and FAULT_MARKER in self.tokenizer.decode(token_ids):
            self._faulty.add(request_id)
        for child in children:
            # A constrained request joins the scheduler once its grammar is compiled.
            if not self.structured.hold(child):
                self.scheduler.add_request(child)

    def add_embedding_request(
        self,
        request_id: str,
        prompts: list[Prompt | ProcessedPrompt],
        params: PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str | None = None,
    ) -> None:
        """Queue an embedding request: one vector per prompt, each prompt prefilled and pooled
        (engine/pooling.py), never sampled; its blocks are freed as its prefill ends.
        Raises ValueError (and adds nothing) on bad input; `input[i]` names a bad prompt."""
        if request_id in self.parents:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        if not isinstance(params, PoolingParams):
            raise ValueError("params must be a PoolingParams")
        if not prompts:
            raise ValueError("input: must hold at least one prompt")
        hidden_size = self.hf_config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValueError(
                f"dimensions: must be <= the model's hidden size {hidden_size}, "
                f"got {params.dimensions}"
            )
        if params.pooling is None:
            if self._checkpoint_pooling is None:
                self._checkpoint_pooling = checkpoint_pooling(resolve_model(self.model_name).folder)
            params = PoolingParams(self._checkpoint_pooling, params.normalize, params.dimensions)
        processed = []
        for i, prompt in enumerate(prompts):
            try:
                processed.append(self.prompts.process(prompt))
            except ValueError as e:
                raise ValueError(f"input[{i}]: {e}") from e
        arrival_time = time.time() if arrival_time is None else arrival_time
        children = [
            Request(
                request_id if len(processed) == 1 else f"{request_id}#{k}",
                p.token_ids,
                SamplingParams(max_tokens=1),  # never sampled: sizes the scheduler's estimates
                p.text,
                priority,
                arrival_time,
                request_id,
                k,
                tenant,
                pooling=PoolingState(params),
            )
            for k, p in enumerate(processed)
        ]
        first = processed[0]
        self.parents[request_id] = _ParentRequest(
            request_id, first.text, first.token_ids, children, []
        )
        for child in children:
            self.scheduler.add_request(child)

    def _check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """What SamplingParams cannot know alone: the vocabulary and the context."""
        vocab = self.hf_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(
                f"stop_token_ids: must be token ids < vocab size {vocab}, got {bad[:3]}"
            )
        room = self.max_model_len - num_prompt_tokens
        if params.min_tokens > room:
            raise ValueError(
                f"min_tokens: must be <= max_model_len - prompt tokens = {room}, "
                f"got {params.min_tokens}"
            )

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown ids are ignored."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        self._faulty.discard(request_id)
        for child in parent.children:
            if not child.status.finished:
                self.structured.forget(child)
                self.isolation.forget(child)
                self.scheduler.abort_request(child.request_id)

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        """Requests (prompts) not finished yet."""
        return len(self.parents)

    def can_admit(self, num_prompt_tokens: int | None = None, num_requests: int = 1) -> bool:
        """Would `num_requests` more requests run soon? Below max_num_seqs (and the state
        slots of a hybrid model), with blocks for their prompts (`num_prompt_tokens` in all;
        four blocks each when not given).

        Counts the blocks the waiting and swapped requests will need, plus a reserve so that
        running requests can still grow without preemption.
        """
        sched, kv = self.scheduler, self.kv_cache_manager
        held = self.structured.held
        busy = len(sched.running) + sched.num_waiting + len(held)
        if busy + num_requests > self.config.max_num_seqs:
            return False
        if self.state_cache is not None and busy + num_requests > self.state_cache.num_slots:
            return False  # every running request of a hybrid model holds a state slot
        if num_prompt_tokens is None:
            num_prompt_tokens = 4 * self.config.block_size
            needed = num_requests * kv.num_blocks_for(num_prompt_tokens)
        else:
            needed = kv.num_blocks_for(num_prompt_tokens)
        needed += self.config.admission_reserve_blocks
        needed += sum(kv.num_blocks_for(r.num_tokens) for r in sched.waiting)
        needed += sum(kv.num_blocks_for(r.num_tokens) for r in sched.swapped)
        needed += sum(kv.num_blocks_for(r.num_tokens) for r in held)
        needed += len(sched.running) // self.config.block_size
        return needed <= kv.num_free_blocks

    # --- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of the requests that advanced or finished.

        If the step raises, the engine rolls it back and finds the culprit by running the
        suspects in halves (see `StepIsolation`); the culprit ends "abort" and its error is
        listed in `failed_requests` (`pop_failed_requests`). The others go on.
        """
        if not self.isolate_failures:
            return self._step()
        return self.isolation.step()

    def pop_failed_requests(self) -> list[tuple[str, str]]:
        """(request_id, error) of the requests ended by step isolation since the last call."""
        failed, self.failed_requests = self.failed_requests, []
        return failed

    def _children(self, parent_id: str) -> list[Request] | None:
        """The samples of a request still in the engine (None once it ended)."""
        parent = self.parents.get(parent_id)
        return parent.children if parent is not None else None

    def _step(self) -> list[RequestOutput]:
        self._release_grammar_requests()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            if self.structured.held and not self._early_outputs:
                self.structured.wait()  # only grammars compiling: wait instead of spinning
            return self._take_early_outputs()
        if self._faulty and any(s.request.parent_id in self._faulty for s in sched_out.scheduled):
            raise InjectedFault("injected test fault (PAGEDQ_TEST_FAULTS)")
        self.check_ranks()
        t0 = time.perf_counter()
        try:
            sampled = self.model_runner.execute_model(sched_out)
        except RankFailure:
            time.sleep(0.1)  # a rank that died broke the collective: name it if it is gone
            self.check_ranks()
            raise
        self.kv_cache_manager.save_state_snapshots(sched_out.scheduled)
        self.scheduler.update_after_step(sched_out, sampled, time.perf_counter() - t0)
        self.num_steps += 1
        touched: dict[str, _ParentRequest] = {}
        now = time.time()
        for row, s in enumerate(sched_out.scheduled):
            req = s.request
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.num_prompt_tokens += min(
                    s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens
                )
            req.num_computed_tokens += s.num_new_tokens
            if req.pooling is not None:
                if req.pooling.embedding is not None and not req.status.finished:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                    touched[req.parent_id] = self.parents[req.parent_id]
                continue
            # A sibling's failure may have ended this sample earlier in the loop.
            if row not in sampled or req.status.finished:
                continue
            token_id, logprobs = sampled[row]
            self._append_token(req, token_id, logprobs, now)
            touched[req.parent_id] = self.parents[req.parent_id]
        outputs = [self._make_output(p) for p in touched.values()]
        # An embedding request is given once, when its last input is pooled.
        outputs = [o for o in outputs if o.finished or isinstance(o, RequestOutput)]
        return self._take_early_outputs() + outputs

    def _append_token(self, req: Request, token_id: int, logprobs, now: float) -> None:
        status = self._record_token(req, token_id, logprobs, now)
        if status is None and req.structured_output_request is not None:
            # A forced token has no distribution of its own: logprob 0 (probability 1).
            forced_logprobs = (lambda t: {t: 0.0}) if logprobs is not None else (lambda t: None)
            status, error = self.structured.advance(
                req,
                token_id,
                lambda t: self._record_token(req, t, forced_logprobs(t), now),
            )
            if error is not None:
                self.structured.num_failed += 1
                self._fail_parent(req.parent_id, error, keep=True)
                return
        if status is not None:
            self.scheduler.finish_request(req, status)

    def _record_token(self, req: Request, token_id: int, logprobs, now: float):
        req.append_output_token(token_id)
        self.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[token_id]
        return self._check_stop(req, token_id)

    # --- structured outputs -------------------------------------------------------------
    def _release_grammar_requests(self) -> None:
        """Schedule the requests whose grammar compiled; fail those whose compile failed."""
        if not self.structured.held or self.isolation.active:
            return
        ready, failed = self.structured.release()
        for request in ready:
            self.scheduler.add_request(request)
        for request, error in failed:
            if request.parent_id in self.parents and not request.status.finished:
                output = self._fail_parent(request.parent_id, error, keep=True)
                self._early_outputs.append(output)

    def _fail_parent(self, parent_id: str, error: str, keep: bool = False) -> RequestOutput:
        """End every sample of a request "abort" and list its error in `failed_requests`
        (a request that makes steps raise, or whose grammar failed); `keep`: leave it in
        `parents` until its early output is taken."""
        parent = self.parents[parent_id]
        for child in parent.children:
            if child.status.finished:
                continue
            self.structured.forget(child)
            if child.request_id in self.scheduler.requests:
                self.isolation.forget(child)
                self.scheduler.abort_request(child.request_id)
            else:  # still waiting for its grammar: it never reached the scheduler
                child.status = RequestStatus.FINISHED_ABORTED
                child.finished_time = time.time()
        self._faulty.discard(parent_id)
        self.failed_requests.append((parent_id, error))
        return self._make_output(parent, keep=keep)

    def _take_early_outputs(self) -> list[RequestOutput]:
        outputs, self._early_outputs = self._early_outputs, []
        for out in outputs:
            self.parents.pop(out.request_id, None)
        return outputs

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        params = req.params
        detok = self.parents[req.parent_id].detokenizers[req.sample_index]
        if token_id in params.stop_token_ids:
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        stop_str = detok.update(token_id)
        if stop_str is not None:
            req.stop_reason = stop_str
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, parent: _ParentRequest, keep: bool = False) -> RequestOutput:
        if parent.children[0].pooling is not None:
            return self._make_embedding_output(parent, keep)
        outputs = []
        for req, detok in zip(parent.children, parent.detokenizers):
            done = req.status.finished
            outputs.append(
                CompletionOutput(
                    index=req.sample_index,
                    text=detok.visible_text(done),
                    token_ids=req.output_token_ids,
                    finish_reason=FINISH_REASONS.get(req.status),
                    stop_reason=req.stop_reason,
                    logprobs=list(req.logprobs) if req.logprobs is not None else None,
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                    num_forced_tokens=getattr(
                        req.structured_output_request, "num_forced_tokens", 0
                    ),
                )
            )
        metrics = self._metrics(parent)
        if metrics.finished_time is not None and not keep:
            del self.parents[parent.request_id]
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outputs,
            metrics.finished_time is not None,
            metrics,
        )

    def _make_embedding_output(
        self, parent: _ParentRequest, keep: bool = False
    ) -> EmbeddingRequestOutput:
        outputs = [
            EmbeddingOutput(r.sample_index, r.pooling.embedding or [], r.num_prompt_tokens)
            for r in parent.children
        ]
        metrics = self._metrics(parent)
        if metrics.finished_time is not None and not keep:
            del self.parents[parent.request_id]
        return EmbeddingRequestOutput(
            parent.request_id,
            parent.prompt_token_ids,
            outputs,
            metrics.finished_time is not None,
            metrics,
        )

    @staticmethod
    def _metrics(parent: _ParentRequest) -> RequestMetrics:
        """A request's milestones over its samples (finished_time: None until all ended)."""
        first = parent.children[0]
        finished = all(r.status.finished for r in parent.children)
        return RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min(
                (r.first_scheduled_time for r in parent.children if r.first_scheduled_time),
                default=None,
            ),
            first_token_time=min(
                (r.first_token_time for r in parent.children if r.first_token_time), default=None
            ),
            finished_time=max(r.finished_time or 0 for r in parent.children) if finished else None,
            num_cached_tokens=first.num_cached_tokens,
            num_preemptions=sum(r.num_preemptions for r in parent.children),
        )

    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's counters."""
        kv, sched, swap = self.kv_cache_manager, self.scheduler, self.swap_space
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.block_pool.num_blocks,
            num_scheduled_tokens=(
                sched.last_output.total_num_scheduled_tokens if sched.last_output else 0
            ),
            num_preemptions=self.scheduler.num_preemptions,
            num_chunked_prefills=self.scheduler.num_chunked_prefills,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions_recompute=sched.num_preemptions_by_kind["recompute"],
            num_preemptions_swap=sched.num_preemptions_by_kind["swap"],
            num_swapped=sched.num_swapped,
            swapped_out_bytes=sched.swapped_out_bytes,
            swap_space_usage=1 - swap.num_free_blocks / swap.num_blocks if swap else 0.0,
            kv_blocks_by_group=kv.usage_by_group(),
            tenant_generated_tokens=dict(sched.fair.generated_tokens),
            mean_queue_time_s=sched.mean_queue_time,
            num_scheduled_requests=sched.num_queue_times,
            generation_tokens_per_s=sched.generation_rate.rate(sched.clock()),
            prefill_tokens_per_s=self.cost_model.prefill_tokens_per_s if self.cost_model else 0.0,
            copy_bytes_per_s=self.cost_model.copy_bytes_per_s if self.cost_model else 0.0,
            num_grammar_compiles=self.structured.compiler.num_compiles,
            grammar_compile_seconds=self.structured.compiler.compile_seconds,
            grammar_cache_hits=self.structured.compiler.num_cache_hits,
            num_waiting_for_grammar=self.structured.num_held,
            num_grammar_failures=self.structured.num_failed,
            num_constrained_tokens=self.structured.num_constrained_tokens,
            num_forced_tokens=self.structured.num_forced_tokens,
        )

"""Packs a step into one flat varlen batch, runs the model, samples the rows that need it."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.block_table import BlockTable
from engine.parallel.cache_ops import replay
from engine.parallel.ranks import RankFailure
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.step_inputs import StepInputs


class ModelRunner:
    """Owns the model and each layer's KV cache ``[2, num_blocks, block_size, kv_heads, dim]``
    (layers of different groups may share a tensor: engine/kv_cache_spec.py).

    ``layer_group[i]`` is layer ``i``'s group: each group has its own block table, slots and
    attention metadata per step.
    """

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        eos_ids: set[int],
        structured=None,
        layer_group: list[int] | None = None,
        state_cache=None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layer_group = layer_group or [0] * len(kv_caches)
        num_groups = max(self.layer_group, default=0) + 1
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.eos_ids = eos_ids
        self.structured = structured  # a StructuredOutputManager: masks constrained rows
        self.state_cache = state_cache  # a StateCache (linear-attention layers), or None
        self.block_tables = [BlockTable(g) for g in range(num_groups)]
        # A length-dependent RoPE needs each request's prompt length (CausalLM.rope_lengths).
        self.uses_prompt_lens = bool(getattr(model, "uses_prompt_lens", False))
        # Tensor parallel, rank 0: each step's plan goes to the other ranks (LLMEngine sets).
        self.plan_channel = None
        self.op_log = None
        model.prepack()

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step's ``StepInputs`` on the CPU: flat ``input_ids``, ``positions``, each
        group's slots and block table, and the rows to sample.

        One O(1) pass per request collects its numbers; everything per token is a torch op.
        """
        scheduled = sched.scheduled
        input_ids, starts, num_new, sample_rows, prompt_lens = [], [], [], [], []
        for row, s in enumerate(scheduled):
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(req.all_token_ids[start:end])
            starts.append(start)
            num_new.append(s.num_new_tokens)
            prompt_lens.append(req.num_prompt_tokens)
            # Only a request whose every token is now computed gets a next-token sample; an
            # embedding request never samples.
            if end == req.num_tokens and req.pooling is None:
                sample_rows.append(row)
        starts_t = torch.tensor(starts)
        num_new_t = torch.tensor(num_new)
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.long)
        torch.cumsum(num_new_t, 0, out=query_start_loc[1:])
        num_tokens = len(input_ids)
        if num_tokens == len(scheduled):  # decodes only: one token per request
            token_req, positions = None, starts_t
        else:
            token_req = torch.repeat_interleave(num_new_t, output_size=num_tokens)
            offsets = torch.arange(num_tokens) - query_start_loc[token_req]
            positions = starts_t[token_req] + offsets
        if len(sample_rows) == num_tokens:  # every token samples: all of hidden, no gather
            logits_indices = slice(None)
        else:
            logits_indices = query_start_loc[1:][sample_rows] - 1 if sample_rows else None
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids),
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=starts_t + num_new_t,
            slot_mappings=[],
            block_tables=[],
            logits_indices=logits_indices,
            sample_rows=sample_rows,
        )
        for table in self.block_tables:
            slots, block_table = self._group_layout(table, scheduled, positions, token_req)
            inputs.slot_mappings.append(slots)
            inputs.block_tables.append(block_table)
        if self.uses_prompt_lens:
            inputs.num_prompt_tokens = torch.tensor(prompt_lens)
        if self.state_cache is not None:
            slots = [self.state_cache.slot(s.request.request_id) for s in scheduled]
            inputs.state_indices = torch.tensor(slots, dtype=torch.long)
            inputs.has_initial_state = starts_t > 0
        return inputs

    def _group_layout(self, table: BlockTable, scheduled, positions, token_req):
        """One group's slot mapping and block table for the step."""
        rows, max_blocks = table.update(scheduled)
        block_table = table.table[:, :max_blocks].index_select(0, torch.tensor(rows))
        if token_req is None:
            token_blocks = block_table.gather(1, (positions // self.block_size)[:, None])[:, 0]
        else:
            token_blocks = block_table[token_req, positions // self.block_size]
        slot_mapping = token_blocks.long() * self.block_size + positions % self.block_size
        return slot_mapping, block_table

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput):
        """Run one step; returns ``{row: (token_id, logprobs)}`` for the rows that sampled."""
        inputs = self.prepare_inputs(sched)
        if self.plan_channel is not None:  # the other ranks run the same step on their shards
            with self._collective():
                self.plan_channel.send(inputs, self.op_log.take())
        sample_rows = inputs.sample_rows
        requests = [sched.scheduled[r].request for r in sample_rows]
        # The grammars' mask is filled while the model runs, and applied before any sampling.
        mask = self.structured.start_bitmask(requests) if self.structured else None
        inputs = inputs.to(self.device)
        metas = inputs.metadata()
        with self._collective():
            hidden = self._forward(inputs, metas)
        self._pool(sched, hidden, metas[0].query_start_loc)
        if not sample_rows:
            return {}
        hidden = hidden[inputs.logits_indices]
        if mask is None and self.sampler.plain_greedy(requests):
            # The argmax in the LM head's GEMM where it can: the logits are never written.
            token_ids = self.model.greedy_token_ids(hidden)
            if token_ids is not None:
                return {row: (tok, None) for row, tok in zip(sample_rows, token_ids)}
        with self._collective():
            logits = self.model.compute_logits(hidden)
        if mask is not None:
            self.structured.apply_bitmask(logits, mask)
        token_ids, logprobs = self.sampler(logits, requests, self.eos_ids)
        return {row: (tok, lp) for row, tok, lp in zip(sample_rows, token_ids, logprobs)}

    @contextmanager
    def _collective(self):
        """Past one rank, any error in the model is the engine's: the other ranks are in (or
        waiting for) the same collectives, so no step can be retried without them."""
        if self.plan_channel is None:
            yield
            return
        try:
            yield
        except Exception as exc:
            raise RankFailure(f"the tensor-parallel step failed: {exc}") from exc

    def _forward(self, inputs: StepInputs, metas) -> torch.Tensor:
        meta = [metas[g] for g in self.layer_group]
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    @torch.inference_mode()
    def follow(self, channel, swap_space, state_cache) -> None:
        """A rank other than 0: run each plan rank 0 sends, on this rank's shard of the model
        and of every cache, until it stops. The logits are computed (the LM head's gather
        needs every rank) and dropped: rank 0 alone samples."""
        while (plan := channel.recv()) is not None:
            inputs, cache_ops = plan
            replay(cache_ops, swap_space, state_cache)
            inputs = inputs.to(self.device)
            hidden = self._forward(inputs, inputs.metadata())
            if inputs.logits_indices is not None:
                self.model.compute_logits(hidden[inputs.logits_indices])

    @staticmethod
    def _pool(sched: SchedulerOutput, hidden: torch.Tensor, query_start_loc) -> None:
        """Give each embedding request's slice of final hidden states to its pooling state."""
        bounds = None
        for row, s in enumerate(sched.scheduled):
            req = s.request
            if req.pooling is None:
                continue
            if bounds is None:
                bounds = query_start_loc.tolist()
            chunk = hidden[bounds[row] : bounds[row + 1]]
            req.pooling.add_chunk(chunk, req.num_computed_tokens, req.num_prompt_tokens)

"""Packs a step into one flat varlen batch, runs the model, samples the rows that need it."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput


class ModelRunner:
    """Owns the model and the per-layer KV caches ``[2, num_blocks, block_size, kv_heads, dim]``."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        eos_ids: set[int],
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.eos_ids = eos_ids

    def prepare_inputs(self, sched: SchedulerOutput):
        """Flat ``input_ids``, ``positions``, attention metadata, and the rows to sample."""
        bs = self.block_size
        input_ids, positions, slot_mapping = [], [], []
        query_start_loc, seq_lens, logits_indices, sample_rows = [0], [], [], []
        max_blocks = max(len(s.block_ids) for s in sched.scheduled)
        block_table = []
        for row, s in enumerate(sched.scheduled):
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            ids = s.block_ids
            slot_mapping.extend(ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            seq_lens.append(end)
            block_table.append(ids + [-1] * (max_blocks - len(ids)))
            # Only a request whose every token is now computed gets a next-token sample.
            if end == req.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                sample_rows.append(row)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=t(slot_mapping),
            query_start_loc=t(query_start_loc),
            seq_lens=t(seq_lens),
            block_table=t(block_table),
        )
        return t(input_ids), t(positions), meta, logits_indices, sample_rows

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput):
        """Run one step; returns ``{row: (token_id, logprobs)}`` for the rows that sampled."""
        input_ids, positions, meta, logits_indices, sample_rows = self.prepare_inputs(sched)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[logits_indices])
        requests = [sched.scheduled[r].request for r in sample_rows]
        token_ids, logprobs = self.sampler(logits, requests, self.eos_ids)
        return {row: (tok, lp) for row, tok, lp in zip(sample_rows, token_ids, logprobs)}

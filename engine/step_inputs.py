"""One step's model inputs: the flat varlen batch the model runner builds from the scheduler's
output, and what every tensor-parallel rank receives from rank 0 (engine/parallel/plan.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from engine.attention import AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    """``input_ids`` and ``positions`` ``[num_tokens]``; the layout shared by every KV group
    (``query_start_loc``, ``seq_lens``); each group's ``slot_mappings[g]`` and
    ``block_tables[g]``; the optional per-request tensors; and the rows whose hidden states
    are sampled (``logits_indices``: a tensor of token rows, ``slice(None)`` for all, or None).

    ``sample_rows`` (which scheduled requests sample) is rank 0's alone: it never leaves it.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mappings: list[torch.Tensor]
    block_tables: list[torch.Tensor]
    num_prompt_tokens: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    logits_indices: torch.Tensor | slice | None = None
    sample_rows: list[int] = field(default_factory=list)

    def to(self, device: torch.device) -> StepInputs:
        """The same inputs on ``device`` (copies started without waiting)."""

        def move(value):
            if isinstance(value, torch.Tensor):
                return value.to(device, non_blocking=True)
            if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                return [move(v) for v in value]
            return value

        return StepInputs(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def metadata(self) -> list[AttentionMetadata]:
        """Each KV group's attention metadata over the shared layout."""
        metas = []
        for slots, table in zip(self.slot_mappings, self.block_tables, strict=True):
            meta = AttentionMetadata(
                slot_mapping=slots,
                query_start_loc=self.query_start_loc,
                seq_lens=self.seq_lens,
                block_table=table,
                num_prompt_tokens=self.num_prompt_tokens,
                state_indices=self.state_indices,
                has_initial_state=self.has_initial_state,
            )
            metas.append(meta)
        return metas

"""The attention backend the model calls: paged KV writes and attention over one flat batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import select_backend, unified_attention, write_kv


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of one step's flat varlen batch, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each token's K/V
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs] context length including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks], -1 padded


class PagedAttention:
    """Writes this step's K/V into the layer's cache, then attends over cached context."""

    def __init__(self, scale: float, backend: str = "auto") -> None:
        self.scale = scale
        self.backend = backend

    def resolve(self, device: torch.device) -> str:
        """The concrete backend ("triton" or "torch") used on ``device``."""
        return select_backend(device, self.backend)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.slot_mapping, backend=self.backend)
        return unified_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            self.scale,
            backend=self.backend,
        )

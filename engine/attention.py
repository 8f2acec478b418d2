"""The attention backend the model calls: paged KV writes and attention over one flat batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import plan_attention, select_backend, unified_attention, write_kv


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of one step's flat varlen batch, shared by every layer.

    The model runner builds one per step; the first layer adds the backend's plan (``plan``,
    ``plan_backend``) so that the other layers reuse it. A runner that reuses one object across
    steps must reset ``plan_backend = None`` whenever the layout tensors change.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each token's K/V
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs] context length including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks], -1 padded
    plan: object | None = None  # the backend's per-step plan, built by the first layer
    plan_backend: str | None = None  # the backend ``plan`` was built for

    def plan_for(self, backend: str, block_size: int):
        """The step's plan for ``backend`` (built at the first call, then reused)."""
        if self.plan_backend != backend:
            self.plan = plan_attention(
                backend, self.query_start_loc, self.seq_lens, self.block_table, block_size
            )
            self.plan_backend = backend
        return self.plan


class PagedAttention:
    """Writes this step's K/V into the layer's cache, then attends over cached context."""

    def __init__(self, scale: float, backend: str = "auto") -> None:
        self.scale = scale
        self.backend = backend
        self._resolved: dict[torch.device, str] = {}

    def resolve(self, device: torch.device) -> str:
        """The concrete backend ("triton", "cpu" or "torch") used on ``device``."""
        chosen = self._resolved.get(device)
        if chosen is None:
            chosen = self._resolved[device] = select_backend(device, self.backend)
        return chosen

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        backend = self.resolve(query.device)
        write_kv(key, value, kv_cache, meta.slot_mapping, backend=backend)
        return unified_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            self.scale,
            backend=backend,
            plan=meta.plan_for(backend, kv_cache.shape[2]),
        )

"""Checkpoints that fuse q, k and v per head (``[heads, 3, head_dim]`` rows: each head's q, k
and v in turn; BLOOM, GPT-NeoX-Japanese) split into pagedq's separate q/k/v shards at load."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def split_per_head(
    weights: Iterable[tuple[str, torch.Tensor]], fused: str, heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each tensor named ``...{fused}...`` (weight or bias) replaced by its q, k
    and v parts, named ``q_proj``, ``k_proj``, ``v_proj`` in its place."""
    for name, tensor in weights:
        if f".{fused}." not in name:
            yield name, tensor
            continue
        rest = tensor.shape[1:]
        per_head = tensor.view(heads, 3, -1, *rest)
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            yield (
                name.replace(f".{fused}.", f".{part}."),
                per_head[:, i].reshape(-1, *rest).contiguous(),
            )

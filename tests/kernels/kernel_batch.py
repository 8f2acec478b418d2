"""Random paged batches and error measures for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim], a non-contiguous view of a qkv tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor  # shuffled physical blocks, a non-contiguous view, -1 padded
    scale: float


def random_batch(
    rng: torch.Generator,
    query_lens: list[int],
    context_lens: list[int],
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int32,
) -> PagedBatch:
    """Request i has ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones."""
    num_heads = num_kv_heads * queries_per_kv
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that no request owns
    physical = torch.randperm(num_blocks, generator=rng)
    width = max(blocks_per_seq) + 2
    wide = torch.full((len(seq_lens), 2 * width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        wide[i, : 2 * n : 2] = physical[used : used + n].to(torch.int32)
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=rng)
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=rng)
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return PagedBatch(
        query=qkv.to(dtype)[:, :num_heads],
        kv_cache=kv_cache.to(dtype),
        query_start_loc=starts.to(index_dtype),
        seq_lens=torch.tensor(seq_lens, dtype=index_dtype),
        block_table=wide.to(index_dtype)[:, ::2],
        scale=head_dim**-0.5,
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute error relative to the largest magnitude of ``expected``."""
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))

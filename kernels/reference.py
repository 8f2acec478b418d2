"""Torch reference kernels: the CPU path and the oracle for the Triton kernels.

Layout of one layer's cache: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    Slot ``s`` is row ``s % block_size`` of block ``s // block_size``; slots of -1 are skipped.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[num_kv_heads, seq_len, head_dim]`` K and V of one request."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    kv = kv_cache[:, block_ids[:num_blocks]].reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len]
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


def unified_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention over a flat varlen batch of prefill chunks and decodes.

    ``query`` is ``[num_tokens, num_heads, head_dim]``; request ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``, which are the last tokens of its context of
    ``seq_lens[i]`` tokens stored in the blocks ``block_table[i]``.
    """
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    if decodes:
        _decode_attention(query, kv_cache, starts, lens, block_table, scale, out, decodes)
    for i, q_len in enumerate(query_lens):
        if q_len > 1:
            _prefill_attention(query, kv_cache, starts[i], q_len, lens[i], block_table[i], scale, out)
    return out


def _prefill_attention(query, kv_cache, start, q_len, seq_len, block_ids, scale, out) -> None:
    k, v = _gather_kv(kv_cache, block_ids, seq_len)
    q = query[start : start + q_len].transpose(0, 1)
    num_context = seq_len - q_len
    # Query row j sits at absolute position num_context + j and sees keys 0..num_context + j.
    key_pos = torch.arange(seq_len, device=query.device)
    query_pos = torch.arange(num_context, seq_len, device=query.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=True,
    )
    out[start : start + q_len] = o[0].transpose(0, 1)


def _decode_attention(query, kv_cache, starts, lens, block_table, scale, out, decodes) -> None:
    """All single-token queries at once: one gather, one padded masked attention."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    device = query.device
    rows = torch.tensor([starts[i] for i in decodes], device=device)
    seq_lens = torch.tensor([lens[i] for i in decodes], device=device)
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    blocks = block_table[torch.tensor(decodes, device=device), :num_blocks].clamp_min(0)
    kv = kv_cache[:, blocks].reshape(2, len(decodes), -1, num_kv_heads, head_dim)[:, :, :max_len]
    k = kv[0].transpose(1, 2)
    v = kv[1].transpose(1, 2)
    q = query[rows].unsqueeze(2)  # [batch, num_heads, 1, head_dim]
    mask = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    out[rows] = o.squeeze(2)

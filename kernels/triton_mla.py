"""Triton kernels: latent attention (DeepSeek MLA) over a paged latent cache, and its write.

One attention program owns one query token and a block of ``BLOCK_H`` heads (rows of the dot
products; at least 16 for ``tl.dot``). Per tile of ``TILE_N`` keys it loads each cache row once
for all its heads, as the latent ``[TILE_N, L]`` and the rope key ``[TILE_N, R]``; the scores are
``q_latent @ c^T + q_pe @ k_pe^T`` and the output accumulates ``p @ c`` (the latent is the
value), with an online softmax in fp32, base 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.shape_checks import check_latent_cache
from kernels.triton_common import LOG2E, cast, dot, interpreting


@triton.jit
def _find_token_seq(query_start_loc_ptr, token, num_seqs):
    # The last request whose first row is <= token (empty requests before it share its start).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mla_attention_kernel(
    out_ptr, q_latent_ptr, q_pe_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, stride_lt, stride_lh, stride_pt, stride_ph, stride_ot, stride_oh,
    stride_bt, stride_bn, stride_cb, stride_cs, num_seqs, num_heads, rank, rope_dim, qk_scale,
    BLOCK_H: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    seq = _find_token_seq(query_start_loc_ptr, token, num_seqs)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    query_pos = seq_len - (q_end - token)  # this token's position in its sequence
    dl = tl.arange(0, RANK_PAD)
    dr = tl.arange(0, ROPE_PAD)
    t64 = token.to(tl.int64)
    q_lat = tl.load(
        q_latent_ptr + t64 * stride_lt + heads[:, None] * stride_lh + dl[None, :],
        mask=head_mask[:, None] & (dl < rank)[None, :], other=0.0,
    )  # fmt: skip
    q_pe = tl.load(
        q_pe_ptr + t64 * stride_pt + heads[:, None] * stride_ph + dr[None, :],
        mask=head_mask[:, None] & (dr < rope_dim)[None, :], other=0.0,
    )  # fmt: skip
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(0, query_pos + 1, TILE_N):
        key_pos = tile_start + tl.arange(0, TILE_N)
        key_mask = key_pos <= query_pos
        block = tl.load(table_row + (key_pos // BLOCK_SIZE) * stride_bn, mask=key_mask, other=0)
        row = block.to(tl.int64) * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs
        c = tl.load(cache_ptr + row[:, None] + dl[None, :],
                    mask=key_mask[:, None] & (dl < rank)[None, :], other=0.0)  # fmt: skip
        k_pe = tl.load(cache_ptr + row[:, None] + rank + dr[None, :],
                       mask=key_mask[:, None] & (dr < rope_dim)[None, :], other=0.0)  # fmt: skip
        c = c.to(q_lat.dtype)
        s = dot(q_lat, tl.trans(c), DOT_PRECISION, INTERPRET)
        s += dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), DOT_PRECISION, INTERPRET)
        s = tl.where(key_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(cast(p, c.dtype, INTERPRET), c, DOT_PRECISION, INTERPRET)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + dl[None, :],
        cast(out, out_ptr.dtype.element_ty, INTERPRET),
        mask=head_mask[:, None] & (dl < rank)[None, :],
    )


def mla_attention_triton(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of ``kernels.mla.mla_attention_torch``."""
    check_latent_cache(q_latent, q_pe, latent_cache)
    out = torch.empty_like(q_latent) if out is None else out
    num_tokens, num_heads, rank = q_latent.shape
    if num_tokens == 0:
        return out
    for name, x in (("q_latent", q_latent), ("q_pe", q_pe), ("out", out), ("cache", latent_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dim")
    block_h = 16
    _mla_attention_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out, q_latent, q_pe, latent_cache, block_table, seq_lens, query_start_loc,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0),
        out.stride(1), block_table.stride(0), block_table.stride(1), latent_cache.stride(0),
        latent_cache.stride(1), query_start_loc.shape[0] - 1, num_heads, rank, q_pe.shape[2],
        float(scale) * LOG2E,
        BLOCK_H=block_h, RANK_PAD=max(16, triton.next_power_of_2(rank)),
        ROPE_PAD=max(16, triton.next_power_of_2(q_pe.shape[2])), BLOCK_SIZE=latent_cache.shape[1],
        TILE_N=16, DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        INTERPRET=interpreting(),
    )  # fmt: skip
    return out


@triton.jit
def _write_latent_kernel(
    latent_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, stride_lt, stride_pt, stride_cb,
    stride_cs, rank, rope_dim,
    BLOCK_SIZE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dl = tl.arange(0, RANK_PAD)
    dr = tl.arange(0, ROPE_PAD)
    t64 = token.to(tl.int64)
    c = tl.load(latent_ptr + t64 * stride_lt + dl, mask=dl < rank)
    k = tl.load(k_pe_ptr + t64 * stride_pt + dr, mask=dr < rope_dim)
    dtype = cache_ptr.dtype.element_ty
    tl.store(row + dl, cast(c, dtype, INTERPRET), mask=dl < rank)
    tl.store(row + rank + dr, cast(k, dtype, INTERPRET), mask=dr < rope_dim)


def write_latent_triton(
    latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """Triton twin of ``kernels.mla.write_latent_torch``: one program per token."""
    check_latent_cache(latent, k_pe, latent_cache)
    if latent.shape[0] == 0:
        return
    _write_latent_kernel[(latent.shape[0],)](
        latent, k_pe, latent_cache, slot_mapping, latent.stride(0), k_pe.stride(0),
        latent_cache.stride(0), latent_cache.stride(1), latent.shape[1], k_pe.shape[1],
        BLOCK_SIZE=latent_cache.shape[1], RANK_PAD=triton.next_power_of_2(latent.shape[1]),
        ROPE_PAD=triton.next_power_of_2(k_pe.shape[1]), INTERPRET=interpreting(),
    )  # fmt: skip

"""Split-K paged decode: long contexts of few requests split over more programs, then merged.

With one program per (request, KV head), a handful of long decodes leaves most of a GPU idle.
Here each context is cut into ``NUM_SPLITS`` segments; every segment writes its partial output
with its softmax max and sum, and a reduction kernel merges the segments exactly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    attend_tiles,
    cast,
    interpreting,
    load_slopes,
    option_args,
    tile_config,
)

MAX_SPLITS = 16


@triton.jit
def _split_decode_kernel(
    partial_out_ptr, partial_m_ptr, partial_l_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_qd, stride_bt, stride_bn,
    stride_cb, stride_cs, stride_ch, stride_cd,
    num_heads, head_dim, qk_scale, window, soft_cap, alibi_ptr,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The segments cover the keys the decode sees: under a sliding window, its last `window`.
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(0, seq_len - window)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first_key, TILE_N), NUM_SPLITS)
    key_start = first_key + split * tiles_per_split * TILE_N
    key_end = tl.minimum(seq_len, key_start + tiles_per_split * TILE_N)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * NUM_QUERIES_PER_KV + rows
    row_mask = rows < NUM_QUERIES_PER_KV
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < head_dim
    q = tl.load(
        q_ptr + token * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr,
        block_table_ptr + seq.to(tl.int64) * stride_bt, stride_bn, kv_head,
        stride_cb, stride_cs, stride_ch, stride_cd,
        key_start, key_end, tl.zeros([BLOCK_M], tl.int32) + seq_len - 1, dim_mask, qk_scale,
        window, soft_cap, load_slopes(alibi_ptr, head, row_mask, HAS_ALIBI),
        BLOCK_SIZE, TILE_N, HEAD_PAD, DOT_PRECISION, INTERPRET, USE_WINDOW, USE_SOFT_CAP,
        HAS_ALIBI,
    )  # fmt: skip
    # An empty split stores l = 0, m = -inf and zeros, which the reduction weighs by 0.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    part = (token * num_heads + head) * NUM_SPLITS + split
    tl.store(partial_out_ptr + part[:, None] * HEAD_PAD + dims[None, :], o, mask=row_mask[:, None])
    tl.store(partial_m_ptr + part, m_i, mask=row_mask)
    tl.store(partial_l_ptr + part, l_i, mask=row_mask)


@triton.jit
def _split_reduce_kernel(
    out_ptr, partial_out_ptr, partial_m_ptr, partial_l_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, stride_od, num_heads, head_dim, sinks_ptr,
    HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, INTERPRET: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(partial_m_ptr + part)
    m_max = tl.max(m, 0)
    if HAS_SINKS:  # the sink joins the denominator once, here: a key of value 0
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    weight = tl.load(partial_l_ptr + part) * tl.exp2(m - m_max)
    o = tl.load(partial_out_ptr + part[:, None] * HEAD_PAD + dims[None, :])
    denominator = tl.sum(weight, 0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - m_max)
    o = tl.sum(o * weight[:, None], 0) / denominator
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
        cast(o, out_ptr.dtype.element_ty, INTERPRET),
        mask=dims < head_dim,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64  # the interpreter: any plausible GPU size keeps the heuristic testable


def pick_num_splits(
    num_tokens: int, num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Split-K factor: > 1 only for decode-only batches too small to fill the GPU on long contexts.

    Every request has at least one new token, so ``num_tokens == num_seqs`` means all decodes.
    """
    if num_tokens != num_seqs or max_seq_len < 1024:
        return 1
    programs = num_seqs * num_kv_heads
    sm_count = _sm_count(device)
    if programs >= sm_count:
        return 1
    want = min(MAX_SPLITS, triton.cdiv(2 * sm_count, programs), max_seq_len // 512)
    return 1 << (want.bit_length() - 1) if want > 1 else 1


def split_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode-only attention (one query per request) with each context split ``num_splits`` ways
    (under a sliding window, the window's keys only)."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens != num_seqs:
        raise ValueError(
            f"split-K needs a decode-only batch, got {num_tokens} tokens for {num_seqs} requests"
        )
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    num_queries_per_kv = num_heads // num_kv_heads
    head_pad, tile_n, precision = tile_config(head_dim, query.dtype)
    shape = (num_tokens, num_heads, num_splits)
    partial_out = torch.empty(*shape, head_pad, dtype=torch.float32, device=query.device)
    partial_m = torch.empty(shape, dtype=torch.float32, device=query.device)
    partial_l = torch.empty(shape, dtype=torch.float32, device=query.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    qk_scale, window, soft_cap = option_args(scale, sliding_window, logits_soft_cap)
    _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_out, partial_m, partial_l, query, k_cache, v_cache, block_table, seq_lens,
        query_start_loc, *query.stride(), *block_table.stride(), *k_cache.stride(),
        num_heads, head_dim, qk_scale, window, soft_cap,
        query if alibi_slopes is None else alibi_slopes,
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        BLOCK_M=max(16, triton.next_power_of_2(num_queries_per_kv)),
        BLOCK_SIZE=block_size, TILE_N=tile_n, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
        DOT_PRECISION=precision, INTERPRET=interpreting(),
        USE_WINDOW=window > 0, USE_SOFT_CAP=soft_cap > 0, HAS_ALIBI=alibi_slopes is not None,
    )  # fmt: skip
    _split_reduce_kernel[(num_seqs, num_heads)](
        out, partial_out, partial_m, partial_l, query_start_loc, *out.stride(),
        num_heads, head_dim, query if sinks is None else sinks,
        HEAD_PAD=head_pad, NUM_SPLITS=num_splits, INTERPRET=interpreting(),
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out

"""Triton unified paged attention over one flat varlen batch of prefill chunks and decodes.

One program owns a tile of ``BLOCK_Q`` query tokens of one request and all the query heads that
share one KV head (``BLOCK_M = BLOCK_Q * num_queries_per_kv`` rows), so each K/V tile is read
once per group. Long decodes with few requests go to ``kernels.triton_split_decode`` instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    attend_tiles,
    cast,
    interpreting,
    join_sinks,
    load_slopes,
    option_args,
    tile_config,
)
from kernels.triton_split_decode import pick_num_splits, split_decode_attention


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # Request i's query tiles are numbered from query_start_loc[i] // BLOCK_Q + i on, which gives
    # each request at least cdiv(query_len, BLOCK_Q) tiles without a host-side sync.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_bt, stride_bn,
    stride_cb, stride_cs, stride_ch, stride_cd, num_seqs, head_dim, qk_scale,
    window, soft_cap, sinks_ptr, alibi_ptr,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_local = first + rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_local < query_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < head_dim
    token = (q_start + q_local).to(tl.int64)
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=io_mask,
        other=0.0,
    )

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # The tile's last query row sees keys up to context_len + first + BLOCK_Q - 1.
    key_end = tl.minimum(seq_len, context_len + first + BLOCK_Q)
    # Under a sliding window, keys before the tile's first row's window are never loaded.
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(0, context_len + first - window + 1)
    acc, l_i, m_i = attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr,
        block_table_ptr + seq.to(tl.int64) * stride_bt, stride_bn, kv_head,
        stride_cb, stride_cs, stride_ch, stride_cd,
        key_start, key_end, context_len + q_local, dim_mask, qk_scale, window, soft_cap,
        load_slopes(alibi_ptr, head, row_mask, HAS_ALIBI),
        BLOCK_SIZE, TILE_N, HEAD_PAD, DOT_PRECISION, INTERPRET, USE_WINDOW, USE_SOFT_CAP,
        HAS_ALIBI,
    )  # fmt: skip
    if HAS_SINKS:
        acc, l_i, m_i = join_sinks(acc, l_i, m_i, sinks_ptr, head, row_mask)
    l_i = tl.where(row_mask, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(
        out_ptr
        + token[:, None] * stride_ot
        + head[:, None] * stride_oh
        + dims[None, :] * stride_od,
        cast(o, out_ptr.dtype.element_ty, INTERPRET),
        mask=io_mask,
    )


def unified_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``unified_attention_torch``.

    ``num_splits`` forces the split-K decode path (decode-only batches); by default
    ``pick_num_splits`` decides, bounding the context by ``max_seq_len`` when given and by the
    block table's width otherwise (that needs no device-to-host sync), and by the sliding
    window. The options are ``kernels.attention_options``'s (None: plain causal attention).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)}: head_dim "
            "must match and num_heads must be a multiple of num_kv_heads"
        )
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc needs num_seqs + 1 = {num_seqs + 1} entries, "
            f"got {query_start_loc.shape[0]}"
        )
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * block_size
    if sliding_window:  # the keys a decode reads
        max_seq_len = min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = pick_num_splits(num_tokens, num_seqs, num_kv_heads, max_seq_len, query.device)
    if num_splits > 1:
        return split_decode_attention(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale, out, num_splits,
            sliding_window, sinks, logits_soft_cap, alibi_slopes,
        )  # fmt: skip
    qk_scale, window, soft_cap = option_args(scale, sliding_window, logits_soft_cap)
    num_queries_per_kv = num_heads // num_kv_heads
    head_pad, tile_n, precision = tile_config(head_dim, query.dtype)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
    if num_tokens >= 4 * num_seqs:  # prefill-heavy: taller tiles reuse each K/V tile more
        block_m = max(block_m, 64)
    block_q = block_m // num_queries_per_kv
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        *query.stride(), *out.stride(), *block_table.stride(), *k_cache.stride(),
        num_seqs, head_dim, qk_scale, window, soft_cap, query if sinks is None else sinks,
        query if alibi_slopes is None else alibi_slopes,
        NUM_QUERIES_PER_KV=num_queries_per_kv, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_SIZE=block_size, TILE_N=tile_n, HEAD_PAD=head_pad, DOT_PRECISION=precision,
        INTERPRET=interpreting(), USE_WINDOW=window > 0, USE_SOFT_CAP=soft_cap > 0,
        HAS_SINKS=sinks is not None, HAS_ALIBI=alibi_slopes is not None,
    )  # fmt: skip
    return out

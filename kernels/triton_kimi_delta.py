"""Triton kernels: Kimi Delta Attention (KDA) over a varlen batch with a state slot per sequence.

The shapes of ``kernels/triton_gated_delta.py`` with a decay per key channel: both kernels keep
a program's ``[k_dim, BLOCK_V]`` part of the fp32 state in registers (columns of the state are
independent); one program per (sequence, head, block of value columns).

- ``kernels.triton_recurrent.delta_rule_recurrent_kernel`` walks the tokens one by one (with
  ``PER_CHANNEL_DECAY``): the decode form, taken when every sequence of the batch has one token.
- ``_chunked_kernel`` walks chunks of ``BLOCK_T`` (16) tokens in the WY form (as
  ``kernels.kimi_delta._chunked_one``; the solve is ``triton_recurrent.wy_chunk``): the prefill
  form.

The per-channel decay from token j to token i does not factor into a row scale times a column
scale without an ``exp(-cum)`` that overflows on strong decays, so the chunked kernel builds the
``[BLOCK_T, BLOCK_T]`` products ``sum_c x_ic k_jc exp(cum_ic - cum_jc)`` one key column ``j`` at a
time (as FLA's chunk_kda does on its diagonal blocks); every exponent is then a decay over a
span of tokens, never positive.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.shape_checks import check_kimi_delta
from kernels.triton_common import cast
from kernels.triton_recurrent import (
    launch_delta_rule,
    load_slot_state,
    prepare_qk,
    sequence_slot,
    wy_chunk,
)

# Chunks of 16 tokens, as triton_gated_delta.py (compile time); the intra-chunk products also
# loop over the chunk's tokens, so a longer chunk would cost quadratically more there.
CHUNK_SIZE = 16


@triton.jit
def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_loc_ptr,
    state_indices_ptr, has_initial_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_gt, stride_gh, stride_bt, stride_s0, stride_s1,
    stride_s2, scale, k_dim, v_dim, queries_per_k,
    HAS_INITIAL_MASK: tl.constexpr, USE_QK_L2NORM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dims = tl.arange(0, BLOCK_K)
    dim_mask = dims < k_dim
    col_mask = cols < v_dim
    start, end, slot = sequence_slot(query_start_loc_ptr, state_indices_ptr, seq)
    k_head = head // queries_per_k  # (1: Kimi Linear has one head count)
    state, state_at, state_mask = load_slot_state(
        state_ptr, has_initial_ptr, seq, slot, head, start, end, dims, cols, dim_mask, col_mask,
        stride_s0, stride_s1, stride_s2, HAS_INITIAL_MASK,
    )  # fmt: skip
    steps = tl.arange(0, BLOCK_T)
    row = steps[:, None]
    col = steps[None, :]
    for c0 in range(start, end, BLOCK_T):
        ts = c0 + steps
        t_mask = ts < end
        qk_mask = t_mask[:, None] & dim_mask[None, :]
        q = tl.load(q_ptr + ts[:, None] * stride_qt + k_head * stride_qh + dims[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # fmt: skip
        k = tl.load(k_ptr + ts[:, None] * stride_kt + k_head * stride_kh + dims[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # fmt: skip
        q, k = prepare_qk(q, k, scale, USE_QK_L2NORM, 1)
        v = tl.load(v_ptr + ts[:, None] * stride_vt + head * stride_vh + cols[None, :],
                    mask=t_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        # Rows past the sequence's end get g = 0, beta = 0: no decay, no write, zero output.
        g = tl.load(g_ptr + ts[:, None] * stride_gt + head * stride_gh + dims[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # fmt: skip
        beta = tl.load(beta_ptr + ts * stride_bt + head, mask=t_mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)  # [BLOCK_T, BLOCK_K] log decay from the chunk's start
        cum_last = tl.sum(tl.where(row == BLOCK_T - 1, cum, 0.0), 0)  # [BLOCK_K]
        k_beta = k * beta[:, None]
        # a (strictly lower) and scores (lower with the diagonal), one key column j at a time
        a = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        scores = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        for j in tl.range(0, BLOCK_T, loop_unroll_factor=1):
            k_j = tl.sum(tl.where(row == j, k, 0.0), 0)
            cum_j = tl.sum(tl.where(row == j, cum, 0.0), 0)
            # decay from token j to each token i >= j; rows i < j are masked before the exp
            decay = tl.exp(tl.where(row >= j, cum - cum_j[None, :], float("-inf")))
            kd = decay * k_j[None, :]
            a_j = tl.where(steps > j, tl.sum(k_beta * kd, 1), 0.0)
            s_j = tl.sum(q * kd, 1)
            a = tl.where(col == j, a_j[:, None], a)
            scores = tl.where(col == j, s_j[:, None], scores)
        o, v_new = wy_chunk(a, scores, q, k_beta, v, beta, tl.exp(cum), state, BLOCK_T)
        o_at = out_ptr + ts[:, None] * stride_ot + head * stride_oh + cols[None, :]
        tl.store(o_at, cast(o, out_ptr.dtype.element_ty, INTERPRET),
                 mask=t_mask[:, None] & col_mask[None, :])  # fmt: skip
        k_tail = k * tl.exp(cum_last[None, :] - cum)  # decay from token j to the chunk's end
        state = state * tl.exp(cum_last)[:, None]
        state += tl.dot(tl.trans(k_tail), v_new, input_precision="ieee")
    tl.store(state_at, state, mask=state_mask)


def kimi_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of ``kernels.kimi_delta.kimi_delta_rule_torch`` (fp32 state pool)."""
    check_kimi_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    if state_pool.dtype != torch.float32 or state_pool.stride(3) != 1:
        raise ValueError("the Triton Kimi delta rule needs an fp32 state pool, unit stride last")
    out = torch.empty_like(v) if out is None else out
    return launch_delta_rule(
        _chunked_kernel, CHUNK_SIZE, True, q, k, v, g, beta, state_pool, query_start_loc,
        state_indices, has_initial_state, use_qk_l2norm, scale, out,
    )  # fmt: skip

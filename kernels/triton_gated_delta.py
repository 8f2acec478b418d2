"""Triton kernels: the gated delta rule over a varlen batch with a state slot per sequence.

Both keep a program's ``[k_dim, BLOCK_V]`` part of the fp32 state in registers (columns of the
state are independent, so blocks of value columns need no communication); one program per
(sequence, value head, block of value columns).

- ``kernels.triton_recurrent.delta_rule_recurrent_kernel`` walks the tokens one by one (FLA's
  ``fused_recurrent`` shape; one decay per head here): the decode form, taken when every
  sequence of the batch has one token.
- ``_chunked_kernel`` walks chunks of ``BLOCK_T`` (16) tokens in the WY form (as
  ``kernels.gated_delta._chunked_one``): inside a chunk the unit lower-triangular system is
  inverted by forward substitution on a ``[BLOCK_T, BLOCK_T]`` tile and the rest are matmuls
  (tensor cores on a GPU; ``triton_recurrent.wy_chunk``), the state carried from chunk to
  chunk: the prefill form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.shape_checks import check_gated_delta
from kernels.triton_common import cast
from kernels.triton_recurrent import (
    launch_delta_rule,
    load_slot_state,
    prepare_qk,
    sequence_slot,
    wy_chunk,
)

# Chunks of 16 tokens, not the reference's 64: the result is the same up to rounding, and
# at 64 (a 64 x 64 system, 64 x 128 q/k tiles) ptxas took over 270 s for one sm80 variant on a
# loaded 2-core VM, against 43 s at 16. (The state's 128 x 64 tile is the same either way.)
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
    k_head = head // queries_per_k
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
        g = tl.load(g_ptr + ts * stride_gt + head * stride_gh, mask=t_mask, other=0.0)
        g = g.to(tl.float32)
        beta = tl.load(beta_ptr + ts * stride_bt + head, mask=t_mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)  # log decay from the chunk's start through each token
        cum_last = tl.sum(tl.where(steps == BLOCK_T - 1, cum, 0.0), 0)
        # decay from token j to token i (i >= j); i < j would overflow exp, so it is zeroed first
        causal = row >= col
        rel_decay = tl.where(
            causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0
        )
        k_beta = k * beta[:, None]
        a = tl.dot(k_beta, tl.trans(k), input_precision="ieee") * rel_decay
        a = tl.where(row > col, a, 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * rel_decay
        o, v_new = wy_chunk(a, scores, q, k_beta, v, beta, tl.exp(cum)[:, None], state, BLOCK_T)
        o_at = out_ptr + ts[:, None] * stride_ot + head * stride_oh + cols[None, :]
        tl.store(o_at, cast(o, out_ptr.dtype.element_ty, INTERPRET),
                 mask=t_mask[:, None] & col_mask[None, :])  # fmt: skip
        k_tail = k * tl.exp(cum_last - cum)[:, None]  # decay from token j to the chunk's end
        state = state * tl.exp(cum_last) + tl.dot(tl.trans(k_tail), v_new, input_precision="ieee")
    tl.store(state_at, state, mask=state_mask)


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of ``kernels.gated_delta.gated_delta_rule_torch`` (fp32 state pool)."""
    check_gated_delta(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    if state_pool.dtype != torch.float32 or state_pool.stride(3) != 1:
        raise ValueError("the Triton gated delta rule needs an fp32 state pool, unit stride last")
    out = torch.empty_like(v) if out is None else out
    return launch_delta_rule(
        _chunked_kernel, CHUNK_SIZE, False, q, k, v, g, beta, state_pool, query_start_loc,
        state_indices, has_initial_state, use_qk_l2norm, scale, out,
    )  # fmt: skip

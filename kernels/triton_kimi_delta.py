"""Triton kernels: Kimi Delta Attention (KDA) over a varlen batch with a state slot per sequence.

The shapes of ``kernels/triton_gated_delta.py`` with a decay per key channel: both kernels keep
a program's ``[k_dim, BLOCK_V]`` part of the fp32 state in registers (columns of the state are
independent); one program per (sequence, head, block of value columns).

- ``_recurrent_kernel`` walks the tokens one by one: the decode form, taken when every sequence
  of the batch has one token.
- ``_chunked_kernel`` walks chunks of ``BLOCK_T`` (16) tokens in the WY form (as
  ``kernels.kimi_delta._chunked_one``): the prefill form.

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
from kernels.triton_common import cast, interpreting

# Chunks of 16 tokens, as triton_gated_delta.py (compile time); the intra-chunk products also
# loop over the chunk's tokens, so a longer chunk would cost quadratically more there.
CHUNK_SIZE = 16


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_loc_ptr,
    state_indices_ptr, has_initial_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_gt, stride_gh, stride_bt, stride_s0, stride_s1,
    stride_s2, scale, k_dim, v_dim,
    HAS_INITIAL_MASK: tl.constexpr, USE_QK_L2NORM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    row_mask = rows < k_dim
    col_mask = cols < v_dim
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
    # (a tensor comparison: the interpreter rejects a scalar bool in a mask)
    state_mask = row_mask[:, None] & col_mask[None, :] & (rows[:, None] * 0 + end > start)
    state_at = (
        state_ptr + slot * stride_s0 + head * stride_s1 + rows[:, None] * stride_s2 + cols[None, :]
    )
    state = tl.load(state_at, mask=state_mask, other=0.0)
    if HAS_INITIAL_MASK:
        state = tl.where(tl.load(has_initial_ptr + seq) != 0, state, 0.0)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + head * stride_qh + rows, mask=row_mask, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + head * stride_kh + rows, mask=row_mask, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        if USE_QK_L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + cols, mask=col_mask, other=0.0)
        g = tl.load(g_ptr + t * stride_gt + head * stride_gh + rows, mask=row_mask, other=0.0)
        beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        state = state * tl.exp(g.to(tl.float32))[:, None]
        delta = (v.to(tl.float32) - tl.sum(state * k[:, None], 0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], 0)
        o_at = out_ptr + t * stride_ot + head * stride_oh + cols
        tl.store(o_at, cast(o, out_ptr.dtype.element_ty, INTERPRET), mask=col_mask)
    tl.store(state_at, state, mask=state_mask)


@triton.jit
def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_loc_ptr,
    state_indices_ptr, has_initial_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_gt, stride_gh, stride_bt, stride_s0, stride_s1,
    stride_s2, scale, k_dim, v_dim,
    HAS_INITIAL_MASK: tl.constexpr, USE_QK_L2NORM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dims = tl.arange(0, BLOCK_K)
    dim_mask = dims < k_dim
    col_mask = cols < v_dim
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
    # (a tensor comparison: the interpreter rejects a scalar bool in a mask)
    state_mask = dim_mask[:, None] & col_mask[None, :] & (dims[:, None] * 0 + end > start)
    state_at = (
        state_ptr + slot * stride_s0 + head * stride_s1 + dims[:, None] * stride_s2 + cols[None, :]
    )
    state = tl.load(state_at, mask=state_mask, other=0.0)
    if HAS_INITIAL_MASK:
        state = tl.where(tl.load(has_initial_ptr + seq) != 0, state, 0.0)
    steps = tl.arange(0, BLOCK_T)
    row = steps[:, None]
    col = steps[None, :]
    for c0 in range(start, end, BLOCK_T):
        ts = c0 + steps
        t_mask = ts < end
        qk_mask = t_mask[:, None] & dim_mask[None, :]
        q = tl.load(q_ptr + ts[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # fmt: skip
        k = tl.load(k_ptr + ts[:, None] * stride_kt + head * stride_kh + dims[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)  # fmt: skip
        if USE_QK_L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
            k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = q * scale
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
        # T = (I + A)^-1 by forward substitution: row i of T is e_i - sum_{j<i} A_ij T_j.
        inv = tl.where(row == col, 1.0, 0.0)
        for i in tl.range(1, BLOCK_T, loop_unroll_factor=1):  # no unrolling: compile time
            a_i = tl.sum(tl.where(row == i, a, 0.0), 0)  # row i of A
            t_i = tl.where(steps == i, 1.0, -tl.sum(a_i[:, None] * inv, 0))
            inv = tl.where(row == i, t_i[None, :], inv)
        u = tl.dot(inv, v * beta[:, None], input_precision="ieee")
        w = tl.dot(inv, k_beta * tl.exp(cum), input_precision="ieee")
        v_new = u - tl.dot(w, state, input_precision="ieee")
        o = tl.dot(q * tl.exp(cum), state, input_precision="ieee")
        o += tl.dot(scores, v_new, input_precision="ieee")
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
    num_seqs = state_indices.shape[0]
    num_heads, k_dim, v_dim = q.shape[1], q.shape[2], v.shape[2]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("g", g), ("beta", beta)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dim")
    block_v = max(16, min(64, triton.next_power_of_2(v_dim)))
    grid = (num_seqs, num_heads, triton.cdiv(v_dim, block_v))
    has_initial = has_initial_state if has_initial_state is not None else state_indices
    # A decode-only batch steps recurrently; any other goes in chunks (a one-token sequence is
    # one chunk of one). Decided from shapes: no device-to-host sync.
    decode_only = q.shape[0] == num_seqs
    kernel = _recurrent_kernel if decode_only else _chunked_kernel
    extra = {} if decode_only else {"BLOCK_T": CHUNK_SIZE}
    kernel[grid](
        q, k, v, g, beta, state_pool, out, query_start_loc, state_indices, has_initial,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), g.stride(0), g.stride(1), beta.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        float(k_dim**-0.5 if scale is None else scale), k_dim, v_dim,
        HAS_INITIAL_MASK=has_initial_state is not None, USE_QK_L2NORM=use_qk_l2norm,
        BLOCK_K=max(16, triton.next_power_of_2(k_dim)), BLOCK_V=block_v,
        INTERPRET=interpreting(), **extra,
    )  # fmt: skip
    return out

"""Triton kernel: the gated delta rule over a varlen batch with a state slot per sequence.

One program per (sequence, value head, block of value columns) holds its ``[k_dim, BLOCK_V]``
part of the fp32 state in registers and walks the sequence's tokens in order (the recurrent
form, FLA's ``fused_recurrent`` shape): columns of the state are independent, so blocks of
value columns need no communication. It serves decodes and prefill chunks alike; a chunked
kernel (the WY form's matmuls on tensor cores) would be faster for long prefills on a GPU and
is not written yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast, interpreting


@triton.jit
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_loc_ptr,
    state_indices_ptr, has_initial_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_gt, stride_bt, stride_s0, stride_s1, stride_s2,
    scale, k_dim, v_dim, queries_per_k,
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
    k_head = head // queries_per_k
    # (a tensor comparison: the interpreter rejects a scalar bool in a mask)
    state_mask = row_mask[:, None] & col_mask[None, :] & (rows[:, None] * 0 + end > start)
    state_at = (
        state_ptr + slot * stride_s0 + head * stride_s1 + rows[:, None] * stride_s2 + cols[None, :]
    )
    state = tl.load(state_at, mask=state_mask, other=0.0)
    if HAS_INITIAL_MASK:
        state = tl.where(tl.load(has_initial_ptr + seq) != 0, state, 0.0)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + k_head * stride_qh + rows, mask=row_mask, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + k_head * stride_kh + rows, mask=row_mask, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        if USE_QK_L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + cols, mask=col_mask, other=0.0)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + head).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        state = state * decay
        delta = (v.to(tl.float32) - tl.sum(state * k[:, None], 0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], 0)
        o_at = out_ptr + t * stride_ot + head * stride_oh + cols
        tl.store(o_at, cast(o, out_ptr.dtype.element_ty, INTERPRET), mask=col_mask)
    tl.store(state_at, state, mask=state_mask)


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of ``kernels.gated_delta.gated_delta_rule_torch`` (fp32 state pool)."""
    from kernels.gated_delta import _check

    _check(q, k, v, g, beta, state_pool, query_start_loc, state_indices)
    if state_pool.dtype != torch.float32 or state_pool.stride(3) != 1:
        raise ValueError("the Triton gated delta rule needs an fp32 state pool, unit stride last")
    out = torch.empty_like(v) if out is None else out
    num_seqs = state_indices.shape[0]
    k_dim, (num_v_heads, v_dim) = q.shape[2], v.shape[1:]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("g", g), ("beta", beta)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dim")
    block_v = min(64, triton.next_power_of_2(v_dim))
    grid = (num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))
    has_initial = has_initial_state if has_initial_state is not None else state_indices
    _gated_delta_kernel[grid](
        q, k, v, g, beta, state_pool, out, query_start_loc, state_indices, has_initial,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), g.stride(0), beta.stride(0), state_pool.stride(0),
        state_pool.stride(1), state_pool.stride(2),
        float(k_dim**-0.5 if scale is None else scale), k_dim, v_dim, num_v_heads // q.shape[1],
        HAS_INITIAL_MASK=has_initial_state is not None, USE_QK_L2NORM=use_qk_l2norm,
        BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v, INTERPRET=interpreting(),
    )  # fmt: skip
    return out

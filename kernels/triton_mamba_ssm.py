"""Triton kernels: the Mamba-2 scan (SSD) over a varlen batch with a state slot per sequence.

Both keep a program's ``[BLOCK_P, state_dim]`` part of the fp32 state in registers (rows of the
state, one per ``head_dim`` channel, are independent, so blocks of rows need no communication);
one program per (sequence, head, block of ``head_dim`` rows).

- ``_recurrent_kernel`` walks the tokens one by one: the decode form, taken when every sequence
  of the batch has one token, and Mamba-1's whole scan (``A`` ``[heads, state_dim]``: a decay
  per state dimension, which the SSD form cannot carry).
- ``_chunked_kernel`` walks chunks of ``BLOCK_T`` tokens in the SSD form (as
  ``kernels.mamba_ssm._chunked_one``): inside a chunk ``y = (C B^T * L) (d x) + exp(cum) C S^T``
  as matmuls (tensor cores on a GPU), the state carried from chunk to chunk: the prefill form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.shape_checks import check_mamba_ssm
from kernels.triton_common import cast, interpreting
from kernels.triton_recurrent import check_unit_stride, load_slot_state, pick_kernel, sequence_slot

# Chunks of 32 tokens, not the reference's 64: the result is the same up to rounding, and the
# fp32 [BLOCK_T, state_dim] B and C tiles (128 state dims) take half the registers.
CHUNK_SIZE = 32


@triton.jit
def _step_size(dt, bias, dt_min, dt_max):
    """``clamp(softplus(dt + bias), dt_min, dt_max)`` in fp32 (torch's softplus threshold 20)."""
    v = dt + bias
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    # log1p(e) without a libdevice call: log(u) * e / (u - 1) cancels u's rounding error.
    sp = tl.where(v > 20.0, v, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
    return tl.minimum(tl.maximum(sp, dt_min), dt_max)


@triton.jit
def _recurrent_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, out_ptr,
    query_start_loc_ptr, state_indices_ptr, has_initial_ptr, stride_xt, stride_xh, stride_dtt,
    stride_bt, stride_bg, stride_ct, stride_cg, stride_ot, stride_oh, stride_s0, stride_s1,
    stride_s2, dt_min, dt_max, head_dim, state_dim, heads_per_group,
    HAS_INITIAL_MASK: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
    A_PER_STATE: tl.constexpr = False,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_N)
    row_mask = rows < head_dim
    dim_mask = dims < state_dim
    start, end, slot = sequence_slot(query_start_loc_ptr, state_indices_ptr, seq)
    group = head // heads_per_group
    state, state_at, state_mask = load_slot_state(
        state_ptr, has_initial_ptr, seq, slot, head, start, end, rows, dims, row_mask, dim_mask,
        stride_s0, stride_s1, stride_s2, HAS_INITIAL_MASK,
    )  # fmt: skip
    if A_PER_STATE:
        a = tl.load(A_ptr + head * state_dim + dims, mask=dim_mask, other=0.0).to(tl.float32)
    else:
        a = tl.load(A_ptr + head).to(tl.float32)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    skip = 0.0
    if HAS_D:
        skip = tl.load(D_ptr + head).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * stride_xt + head * stride_xh + rows, mask=row_mask, other=0.0)
        x = x.to(tl.float32)
        b = tl.load(B_ptr + t * stride_bt + group * stride_bg + dims, mask=dim_mask, other=0.0)
        c = tl.load(C_ptr + t * stride_ct + group * stride_cg + dims, mask=dim_mask, other=0.0)
        d = _step_size(tl.load(dt_ptr + t * stride_dtt + head).to(tl.float32), bias, dt_min, dt_max)
        if A_PER_STATE:
            decay = tl.exp(d * a)[None, :]
        else:
            decay = tl.exp(d * a)
        state = state * decay + (d * x)[:, None] * b.to(tl.float32)[None, :]
        y = tl.sum(state * c.to(tl.float32)[None, :], 1) + skip * x
        o_at = out_ptr + t * stride_ot + head * stride_oh + rows
        tl.store(o_at, cast(y, out_ptr.dtype.element_ty, INTERPRET), mask=row_mask)
    tl.store(state_at, state, mask=state_mask)


@triton.jit
def _chunked_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, out_ptr,
    query_start_loc_ptr, state_indices_ptr, has_initial_ptr, stride_xt, stride_xh, stride_dtt,
    stride_bt, stride_bg, stride_ct, stride_cg, stride_ot, stride_oh, stride_s0, stride_s1,
    stride_s2, dt_min, dt_max, head_dim, state_dim, heads_per_group,
    HAS_INITIAL_MASK: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_N)
    row_mask = rows < head_dim
    dim_mask = dims < state_dim
    start, end, slot = sequence_slot(query_start_loc_ptr, state_indices_ptr, seq)
    group = head // heads_per_group
    state, state_at, state_mask = load_slot_state(
        state_ptr, has_initial_ptr, seq, slot, head, start, end, rows, dims, row_mask, dim_mask,
        stride_s0, stride_s1, stride_s2, HAS_INITIAL_MASK,
    )  # fmt: skip
    a = tl.load(A_ptr + head).to(tl.float32)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    skip = 0.0
    if HAS_D:
        skip = tl.load(D_ptr + head).to(tl.float32)
    steps = tl.arange(0, BLOCK_T)
    causal = steps[:, None] >= steps[None, :]
    for c0 in range(start, end, BLOCK_T):
        ts = c0 + steps
        t_mask = ts < end
        x = tl.load(x_ptr + ts[:, None] * stride_xt + head * stride_xh + rows[None, :],
                    mask=t_mask[:, None] & row_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        bc_mask = t_mask[:, None] & dim_mask[None, :]
        b = tl.load(B_ptr + ts[:, None] * stride_bt + group * stride_bg + dims[None, :],
                    mask=bc_mask, other=0.0).to(tl.float32)  # fmt: skip
        c = tl.load(C_ptr + ts[:, None] * stride_ct + group * stride_cg + dims[None, :],
                    mask=bc_mask, other=0.0).to(tl.float32)  # fmt: skip
        dt = tl.load(dt_ptr + ts * stride_dtt + head, mask=t_mask, other=0.0).to(tl.float32)
        # Rows past the sequence's end get d = 0: no decay, no write (and their output is masked).
        d = tl.where(t_mask, _step_size(dt, bias, dt_min, dt_max), 0.0)
        cum = tl.cumsum(d * a, 0)  # log decay from the chunk's start through each token
        cum_last = tl.sum(tl.where(steps == BLOCK_T - 1, cum, 0.0), 0)
        # decay from token j to token i (i >= j); i < j would overflow exp, so it is zeroed first
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        dx = x * d[:, None]
        scores = tl.dot(c, tl.trans(b), input_precision="ieee") * decay
        y = tl.dot(scores, dx, input_precision="ieee")
        y += tl.dot(c, tl.trans(state), input_precision="ieee") * tl.exp(cum)[:, None]
        y += skip * x
        o_at = out_ptr + ts[:, None] * stride_ot + head * stride_oh + rows[None, :]
        tl.store(o_at, cast(y, out_ptr.dtype.element_ty, INTERPRET),
                 mask=t_mask[:, None] & row_mask[None, :])  # fmt: skip
        dx_tail = dx * tl.exp(cum_last - cum)[:, None]  # decay from token j to the chunk's end
        state = state * tl.exp(cum_last) + tl.dot(tl.trans(dx_tail), b, input_precision="ieee")
    tl.store(state_at, state, mask=state_mask)


def mamba_chunk_scan_triton(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")), out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of ``kernels.mamba_ssm.mamba_chunk_scan_torch`` (fp32 state pool)."""
    check_mamba_ssm(x, dt, A, B, C, D, dt_bias, state_pool, query_start_loc, state_indices,
                    has_initial_state)  # fmt: skip
    if state_pool.dtype != torch.float32 or state_pool.stride(3) != 1:
        raise ValueError("the Triton Mamba-2 scan needs an fp32 state pool, unit stride last")
    out = torch.empty_like(x) if out is None else out
    num_seqs = state_indices.shape[0]
    (num_heads, head_dim), state_dim = x.shape[1:], B.shape[2]
    if num_seqs == 0 or x.shape[0] == 0:
        return out
    check_unit_stride(x=x, B=B, C=C, out=out, dt=dt)
    block_p = max(16, min(64, triton.next_power_of_2(head_dim)))
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
    has_initial = has_initial_state if has_initial_state is not None else state_indices
    A, D, dt_bias = (None if t is None else t.contiguous() for t in (A, D, dt_bias))
    if A.dim() == 2:  # a decay per state dimension (Mamba-1): the recurrent form only
        kernel, extra = _recurrent_kernel, {"A_PER_STATE": True}
    else:
        kernel, extra = pick_kernel(
            x.shape[0], num_seqs, (_recurrent_kernel, {}),
            (_chunked_kernel, {"BLOCK_T": CHUNK_SIZE}),
        )  # fmt: skip
    kernel[grid](
        x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, state_pool,
        out, query_start_loc, state_indices, has_initial, x.stride(0), x.stride(1),
        dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1), out.stride(0),
        out.stride(1), state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        float(dt_limit[0]), float(dt_limit[1]), head_dim, state_dim, num_heads // B.shape[1],
        HAS_INITIAL_MASK=has_initial_state is not None, HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None, BLOCK_P=block_p,
        BLOCK_N=max(16, triton.next_power_of_2(state_dim)), INTERPRET=interpreting(), **extra,
    )  # fmt: skip
    return out

"""Pieces shared by the Triton recurrent-state kernels (``triton_gated_delta``,
``triton_kimi_delta``, ``triton_mamba_ssm``): one program per (sequence, head, block of a state's
rows or columns) over a varlen batch with a state slot per sequence.

- ``sequence_slot``: a program's sequence bounds and slot.
- ``load_slot_state``: its part of the slot's fp32 state (zero where ``has_initial_state`` is
  False), with the pointers and mask that store it back.
- ``prepare_qk``: the delta rules' q and k in fp32, l2-normalised, q scaled.
- ``delta_rule_recurrent_kernel``: both delta rules' token-by-token kernel (a decay per head or
  per key channel); ``wy_chunk``: the WY solve of one chunk their chunked kernels share.
- ``check_unit_stride``, ``pick_kernel``: the launchers' checks and their choice of form;
  ``launch_delta_rule``: both delta rules' launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast, interpreting


@triton.jit
def sequence_slot(query_start_loc_ptr, state_indices_ptr, seq):
    """``(start, end, slot)`` of sequence ``seq``, as int64."""
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
    return start, end, slot


@triton.jit
def load_slot_state(
    state_ptr, has_initial_ptr, seq, slot, head, start, end, rows, cols, row_mask, col_mask,
    stride_s0, stride_s1, stride_s2, HAS_INITIAL_MASK: tl.constexpr,
):  # fmt: skip
    """``(state, state_at, state_mask)``: the ``[rows, cols]`` part of ``head``'s state in
    ``slot`` (columns at unit stride), and where to store it back. An empty sequence's mask is
    all False, so its slot is neither read nor written."""
    # (a tensor comparison: the interpreter rejects a scalar bool in a mask)
    state_mask = row_mask[:, None] & col_mask[None, :] & (rows[:, None] * 0 + end > start)
    state_at = (
        state_ptr + slot * stride_s0 + head * stride_s1 + rows[:, None] * stride_s2 + cols[None, :]
    )
    state = tl.load(state_at, mask=state_mask, other=0.0)
    if HAS_INITIAL_MASK:
        state = tl.where(tl.load(has_initial_ptr + seq) != 0, state, 0.0)
    return state, state_at, state_mask


@triton.jit
def prepare_qk(q, k, scale, USE_QK_L2NORM: tl.constexpr, AXIS: tl.constexpr):
    """q and k in fp32, normalised over ``AXIS`` (``x / sqrt(sum(x^2) + 1e-6)``, FLA's l2norm)
    when ``USE_QK_L2NORM``, q scaled."""
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if USE_QK_L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, AXIS, keep_dims=True) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, AXIS, keep_dims=True) + 1e-6)
    return q * scale, k


@triton.jit
def delta_rule_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, query_start_loc_ptr,
    state_indices_ptr, has_initial_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_gt, stride_gh, stride_bt, stride_s0, stride_s1,
    stride_s2, scale, k_dim, v_dim, queries_per_k,
    HAS_INITIAL_MASK: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PER_CHANNEL_DECAY: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The delta rules token by token (FLA's ``fused_recurrent`` shape): one decay per value head
    (the gated delta rule, key head ``head // queries_per_k``) or, with ``PER_CHANNEL_DECAY``, one
    per key channel (Kimi Delta Attention)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    row_mask = rows < k_dim
    col_mask = cols < v_dim
    start, end, slot = sequence_slot(query_start_loc_ptr, state_indices_ptr, seq)
    k_head = head // queries_per_k
    state, state_at, state_mask = load_slot_state(
        state_ptr, has_initial_ptr, seq, slot, head, start, end, rows, cols, row_mask, col_mask,
        stride_s0, stride_s1, stride_s2, HAS_INITIAL_MASK,
    )  # fmt: skip
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + k_head * stride_qh + rows, mask=row_mask, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + k_head * stride_kh + rows, mask=row_mask, other=0.0)
        q, k = prepare_qk(q, k, scale, USE_QK_L2NORM, 0)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + cols, mask=col_mask, other=0.0)
        beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        if PER_CHANNEL_DECAY:
            g = tl.load(g_ptr + t * stride_gt + head * stride_gh + rows, mask=row_mask, other=0.0)
            state = state * tl.exp(g.to(tl.float32))[:, None]
        else:
            state = state * tl.exp(tl.load(g_ptr + t * stride_gt + head * stride_gh).to(tl.float32))
        delta = (v.to(tl.float32) - tl.sum(state * k[:, None], 0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], 0)
        o_at = out_ptr + t * stride_ot + head * stride_oh + cols
        tl.store(o_at, cast(o, out_ptr.dtype.element_ty, INTERPRET), mask=col_mask)
    tl.store(state_at, state, mask=state_mask)


@triton.jit
def wy_chunk(a, scores, q, k_beta, v, beta, decay_in, state, BLOCK_T: tl.constexpr):
    """One chunk of a delta rule in the WY form, from ``a`` (strictly lower: ``beta_i k_i . k_j``
    decayed from token j to i), ``scores`` (lower: ``q_i . k_j`` so decayed) and ``decay_in``
    (the decay from the chunk's start through each token, per row or per row and key channel):
    ``(o, v_new)``, the chunk's output and what each token writes to the state."""
    steps = tl.arange(0, BLOCK_T)
    row = steps[:, None]
    col = steps[None, :]
    # T = (I + A)^-1 by forward substitution: row i of T is e_i - sum_{j<i} A_ij T_j.
    inv = tl.where(row == col, 1.0, 0.0)
    for i in tl.range(1, BLOCK_T, loop_unroll_factor=1):  # no unrolling: compile time
        a_i = tl.sum(tl.where(row == i, a, 0.0), 0)  # row i of A
        t_i = tl.where(steps == i, 1.0, -tl.sum(a_i[:, None] * inv, 0))
        inv = tl.where(row == i, t_i[None, :], inv)
    u = tl.dot(inv, v * beta[:, None], input_precision="ieee")
    w = tl.dot(inv, k_beta * decay_in, input_precision="ieee")
    v_new = u - tl.dot(w, state, input_precision="ieee")
    o = tl.dot(q * decay_in, state, input_precision="ieee")
    o += tl.dot(scores, v_new, input_precision="ieee")
    return o, v_new


def check_unit_stride(**tensors: torch.Tensor) -> None:
    """Each of ``tensors`` has unit stride in its last dim (the kernels' loads assume it)."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride in its last dim")


def pick_kernel(
    num_tokens: int, num_seqs: int, recurrent: tuple[triton.JITFunction, dict],
    chunked: tuple[triton.JITFunction, dict],
) -> tuple[triton.JITFunction, dict]:  # fmt: skip
    """A decode-only batch steps recurrently; any other goes in chunks (a one-token sequence is
    one chunk of one). Decided from shapes: no device-to-host sync. Each form is its kernel and
    the constexprs only it takes."""
    return recurrent if num_tokens == num_seqs else chunked


def launch_delta_rule(
    chunked_kernel: triton.JITFunction, chunk_size: int, per_channel_decay: bool,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None, use_qk_l2norm: bool, scale: float | None,
    out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Launch a delta rule (arguments checked) on ``delta_rule_recurrent_kernel`` or
    ``chunked_kernel`` (which takes the same arguments, and ``BLOCK_T`` for
    ``PER_CHANNEL_DECAY``): one program per (sequence, value head, block of value columns)."""
    num_seqs = state_indices.shape[0]
    k_dim, (num_v_heads, v_dim) = q.shape[2], v.shape[1:]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    check_unit_stride(q=q, k=k, v=v, out=out, g=g, beta=beta)
    block_v = max(16, min(64, triton.next_power_of_2(v_dim)))
    grid = (num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))
    has_initial = has_initial_state if has_initial_state is not None else state_indices
    recurrent = (delta_rule_recurrent_kernel, {"PER_CHANNEL_DECAY": per_channel_decay})
    chunked = (chunked_kernel, {"BLOCK_T": chunk_size})
    kernel, extra = pick_kernel(q.shape[0], num_seqs, recurrent, chunked)
    kernel[grid](
        q, k, v, g, beta, state_pool, out, query_start_loc, state_indices, has_initial,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), g.stride(0), g.stride(1), beta.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        float(k_dim**-0.5 if scale is None else scale), k_dim, v_dim, num_v_heads // q.shape[1],
        HAS_INITIAL_MASK=has_initial_state is not None, USE_QK_L2NORM=use_qk_l2norm,
        BLOCK_K=max(16, triton.next_power_of_2(k_dim)), BLOCK_V=block_v,
        INTERPRET=interpreting(), **extra,
    )  # fmt: skip
    return out

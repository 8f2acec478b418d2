"""Triton kernel: the varlen causal depthwise conv1d of Gated DeltaNet with conv state slots.

One program per (sequence, block of channels) walks the sequence in tiles of tokens; each output
reads its ``kernel_size`` inputs from ``state ++ x`` (the slot's state for positions before the
first row), and at the end the program writes the last ``kernel_size - 1`` inputs back to the
slot, after a barrier, because its own earlier loads read the old state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.shape_checks import check_causal_conv1d
from kernels.triton_common import cast, interpreting


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, query_start_loc_ptr, state_indices_ptr,
    has_initial_ptr, stride_xt, stride_ot, stride_w0, stride_w1, stride_s0, stride_s1, stride_s2,
    dim,
    KERNEL: tl.constexpr, WIDTH_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_INITIAL_MASK: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_mask = chans < dim
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    length = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - start
    state_base = state_ptr + tl.load(state_indices_ptr + seq).to(tl.int64) * stride_s0
    state_base += chans[None, :] * stride_s1
    flag = length  # > 0 where the slot's state is read: a non-empty sequence...
    if HAS_INITIAL_MASK:
        flag = flag * tl.load(has_initial_ptr + seq).to(tl.int64)  # ...that continues
    # Masks from tensor comparisons: the interpreter rejects scalar bools in a mask.
    use_state = chans[None, :] * 0 + flag > 0
    width = KERNEL - 1
    dtype = out_ptr.dtype.element_ty
    for t0 in range(0, length, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_mask = (ts < length)[:, None] & chan_mask[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + chans, mask=chan_mask, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(KERNEL):
            n = (ts + j)[:, None]  # position in state ++ x
            from_x = n >= width
            xv = tl.load(x_ptr + (start + n - width) * stride_xt + chans[None, :],
                         mask=t_mask & from_x, other=0.0)  # fmt: skip
            sv = tl.load(state_base + n * stride_s2, mask=t_mask & (n < width) & use_state,
                         other=0.0)  # fmt: skip
            w = tl.load(w_ptr + chans * stride_w0 + j * stride_w1, mask=chan_mask, other=0.0)
            acc += tl.where(from_x, xv, sv).to(tl.float32) * w.to(tl.float32)[None, :]
        y = cast(acc, dtype, INTERPRET).to(tl.float32)  # rounded before SiLU, as transformers
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        out_at = out_ptr + (start + ts)[:, None] * stride_ot + chans[None, :]
        tl.store(out_at, cast(y, dtype, INTERPRET), mask=t_mask)
    i = tl.arange(0, WIDTH_PAD)[:, None]
    m = length + i  # the new state's inputs, as positions in state ++ x
    keep = (i < width) & chan_mask[None, :] & (i * 0 + length > 0)
    xv = tl.load(x_ptr + (start + m - width) * stride_xt + chans[None, :],
                 mask=keep & (m >= width), other=0.0)  # fmt: skip
    sv = tl.load(state_base + m * stride_s2, mask=keep & (m < width) & use_state, other=0.0)
    new = tl.where(m >= width, xv.to(tl.float32), sv.to(tl.float32))
    tl.debug_barrier()
    tl.store(state_base + i * stride_s2, cast(new, state_ptr.dtype.element_ty, INTERPRET),
             mask=keep)  # fmt: skip


def causal_conv1d_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton twin of ``kernels.causal_conv1d.causal_conv1d_torch``."""
    check_causal_conv1d(x, weight, conv_state_pool, activation)
    out = torch.empty_like(x) if out is None else out
    num_seqs, dim = state_indices.shape[0], x.shape[1]
    if num_seqs == 0 or x.shape[0] == 0:
        return out
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out need unit stride in their last dim")
    block_c = min(64, triton.next_power_of_2(dim))
    kernel = weight.shape[1]
    _causal_conv1d_kernel[(num_seqs, triton.cdiv(dim, block_c))](
        x, weight, bias if bias is not None else weight, conv_state_pool, out, query_start_loc,
        state_indices, has_initial_state if has_initial_state is not None else state_indices,
        x.stride(0), out.stride(0), weight.stride(0), weight.stride(1), *conv_state_pool.stride(),
        dim,
        KERNEL=kernel, WIDTH_PAD=max(2, triton.next_power_of_2(kernel - 1)),
        HAS_BIAS=bias is not None, HAS_INITIAL_MASK=has_initial_state is not None,
        SILU=activation == "silu", BLOCK_T=16, BLOCK_C=block_c, INTERPRET=interpreting(),
    )  # fmt: skip
    return out

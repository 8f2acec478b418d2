"""The short causal depthwise convolution in front of Gated DeltaNet, over a varlen batch.

``x`` is ``[num_tokens, dim]`` (the flat batch, the qkv projection's output); sequence ``i`` owns
rows ``query_start_loc[i]:query_start_loc[i+1]`` and slot ``state_indices[i]`` of the conv state
pool ``[num_slots, dim, kernel_size - 1]``: the inputs of the ``kernel_size - 1`` tokens before its
first row (zeros where ``has_initial_state[i]`` is False, i.e. a new sequence). Output row ``t`` of
channel ``c`` is ``act(bias[c] + sum_j weight[c, j] * x_ext[t + j])`` over ``x_ext = state ++ x``;
the last ``kernel_size - 1`` inputs of ``x_ext`` are written back, so the next chunk (or decode
token) of the sequence continues where this one stopped.

Numerics are transformers' (``causal_conv1d_fn`` / ``causal_conv1d_update`` of Qwen3.5): the sum
in fp32 (float64 for float64 inputs), rounded to ``x``'s dtype, then SiLU, rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.shape_checks import check_causal_conv1d
from kernels.state_slots import choose_backend, cpu_slot_args


def _finish(y: torch.Tensor, dtype: torch.dtype, activation: str | None) -> torch.Tensor:
    y = y.to(dtype)  # transformers rounds the convolution before the activation
    if activation == "silu":
        y = F.silu(y.to(torch.promote_types(dtype, torch.float32))).to(dtype)
    return y


def causal_conv1d_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference of the varlen convolution; updates ``conv_state_pool`` in place."""
    check_causal_conv1d(x, weight, conv_state_pool, activation)
    dtype = torch.promote_types(x.dtype, torch.float32)
    width = weight.shape[1] - 1
    out = torch.empty_like(x) if out is None else out
    w = weight.to(dtype)[:, None, :]
    b = None if bias is None else bias.to(dtype)
    bounds = query_start_loc.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end == start:
            continue
        slot = int(state_indices[i])
        state = conv_state_pool[slot].to(dtype)
        if has_initial_state is not None and not bool(has_initial_state[i]):
            state = torch.zeros_like(state)
        extended = torch.cat([state, x[start:end].t().to(dtype)], dim=1)  # [dim, width + len]
        y = F.conv1d(extended[None], w, b, groups=x.shape[1])[0]
        out[start:end] = _finish(y.t(), x.dtype, activation)
        conv_state_pool[slot] = extended[:, extended.shape[1] - width :].to(conv_state_pool.dtype)
    return out


def causal_conv1d_update_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor, state_indices: torch.Tensor, activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference of the decode step: row ``i`` of ``x`` is one token of sequence ``i``."""
    check_causal_conv1d(x, weight, conv_state_pool, activation)
    dtype = torch.promote_types(x.dtype, torch.float32)
    slots = state_indices.long()
    extended = torch.cat([conv_state_pool[slots].to(dtype), x.to(dtype)[:, :, None]], dim=2)
    y = (extended * weight.to(dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(dtype)
    result = _finish(y, x.dtype, activation)
    conv_state_pool[slots] = extended[:, :, 1:].to(conv_state_pool.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, activation: str | None = "silu",
    out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """The varlen causal convolution of one step (prefill chunks and decodes mixed); Triton on
    CUDA, C++ on the CPU, else the reference."""
    args = (x, weight, bias, conv_state_pool, query_start_loc, state_indices, has_initial_state)
    same = {x.dtype, weight.dtype, conv_state_pool.dtype} | (
        {bias.dtype} if bias is not None else set()
    )
    cpu_fits = len(same) == 1 and x.dtype in (torch.float32, torch.bfloat16)
    chosen = choose_backend(x.device, backend, cpu_fits)
    if chosen == "triton":
        from kernels.triton_causal_conv1d import causal_conv1d_triton

        return causal_conv1d_triton(*args, activation, out)
    if chosen == "cpu":
        return causal_conv1d_cpu(*args, activation, out)
    return causal_conv1d_torch(*args, activation, out)


def causal_conv1d_cpu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None, activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """C++ twin of ``causal_conv1d_torch`` (``kernels/csrc/causal_conv1d_cpu.cpp``); x, weight,
    bias and the pool share one dtype, fp32 or bf16."""
    check_causal_conv1d(x, weight, conv_state_pool, activation)
    slot_args = cpu_slot_args(query_start_loc, state_indices, has_initial_state)
    out = torch.empty_like(x) if out is None else out
    torch.ops.pagedq.causal_conv1d(
        x, weight, bias, conv_state_pool, *slot_args, activation == "silu", out
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor, state_indices: torch.Tensor, activation: str | None = "silu",
    out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """The decode step (row ``i`` of ``x`` is the one new token of sequence ``i``): the varlen
    kernel with one token per sequence on C++ and Triton, the batched reference otherwise."""
    from kernels import select_backend

    if select_backend(x.device, backend) == "torch":
        return causal_conv1d_update_torch(
            x, weight, bias, conv_state_pool, state_indices, activation, out
        )
    starts = torch.arange(x.shape[0] + 1, device=x.device)
    return causal_conv1d(
        x, weight, bias, conv_state_pool, starts, state_indices, None, activation, out, backend
    )

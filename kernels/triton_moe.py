"""Mixture-of-experts layers on CUDA (Triton): grouped expert GEMMs over routed tokens.

The (token, slot) pairs are sorted by expert and each expert's run padded to a whole block of
``BLOCK_M`` rows (``moe_align_block_size``: the sorted pair ids, with padding ids that point
past the last pair, and the expert of each block), so that one program owns a block of rows of
one expert and a block of output columns, and loads that expert's weights once for all of them.
Two launches per layer: gate_up (the gathered rows of x; the activation then runs in torch),
and down (the intermediate rows; each row scaled by its routing weight in the epilogue), then a
sum over each token's top_k rows. Verified against the torch reference under
``TRITON_INTERPRET=1`` (tests/kernels/test_moe_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import moe_activation_torch
from kernels.triton_common import cast, dot, interpreting


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, expert_ids)``: pair ids (``token * top_k + slot``) grouped by expert, each
    group padded with ``topk_ids.numel()`` to a multiple of ``block_m``; the expert of each
    block of ``block_m`` entries. Torch ops only, no loop over experts."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = padded.cumsum(0) - padded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((int(padded.sum()),), pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[starts[expert] + rank] = order
    blocks = padded // block_m
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), blocks)
    return sorted_ids, expert_ids


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x (rows = tokens, A_DIV = top_k) or the intermediate (rows = pairs)
    w_ptr,  # [E, N, K]
    bias_ptr,  # [E, N] fp32, or a dummy
    weights_ptr,  # [pairs] fp32 routing weights, or a dummy
    c_ptr,  # [pairs, N]
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_pairs
    a_rows = rows // A_DIV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc += dot(a, w, DOT_PRECISION, INTERPRET)
    dtype = c_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + cols, mask=col_ok, other=0.0)[None, :]
    if MUL_WEIGHT:
        # The expert's output as its dtype leaves it, then times the routing weight.
        acc = cast(acc, a_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
        acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :],
        cast(acc, dtype, INTERPRET),
        mask=valid[:, None] & col_ok[None, :],
    )


def _grouped_gemm(a, w, bias, weights, sorted_ids, expert_ids, num_pairs, a_div, out, block):
    block_m, block_n, block_k = block
    n, k = w.shape[1], w.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    dummy = out  # never read: HAS_BIAS / MUL_WEIGHT are False
    _grouped_gemm_kernel[grid](
        a, w, dummy if bias is None else bias, dummy if weights is None else weights, out,
        sorted_ids, expert_ids, num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), A_DIV=a_div, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        INTERPRET=interpreting(),
    )  # fmt: skip


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    block: tuple[int, int, int] = (16, 64, 32),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton twin of ``kernels.reference.fused_experts_torch`` (same arguments)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, w13.shape[0], block[0])
    bias13 = None if w13_bias is None else w13_bias.float().contiguous()
    bias2 = None if w2_bias is None else w2_bias.float().contiguous()
    gate_up = x.new_empty(num_pairs, w13.shape[1])
    _grouped_gemm(x, w13, bias13, None, sorted_ids, expert_ids, num_pairs, top_k, gate_up, block)
    inter = moe_activation_torch(gate_up, activation, alpha, limit).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    y = x.new_empty(num_pairs, w2.shape[1], dtype=torch.float32)
    _grouped_gemm(inter, w2, bias2, weights, sorted_ids, expert_ids, num_pairs, 1, y, block)
    return y.view(num_tokens, top_k, -1).sum(dim=1).to(out_dtype or x.dtype)

"""Fused residual add + RMSNorm in one pass (Triton), and its torch reference.

Numerics are the reference's: the residual sum is rounded to the residual's dtype (x's, or fp32),
the norm and its scale (an fp32 weight or one of x's dtype) run in fp32 and are rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import rms_norm_torch  # noqa: F401  (the oracle, re-exported)
from kernels.triton_common import cast, interpreting


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_out,
    stride_x,
    stride_r,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = cast(x + r, residual_ptr.dtype.element_ty, INTERPRET)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden_size + eps)
    y = x * inv_rms
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast(w * y, dtype, INTERPRET), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of ``rms_norm_torch`` for ``x`` ``[num_tokens, hidden]``.

    The new residual ``x + residual`` is written into ``residual`` in place and returned.
    """
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x must be [num_tokens, hidden] with unit stride on hidden and weight [hidden], got "
            f"x {tuple(x.shape)} strides {x.stride()} and weight {tuple(weight.shape)}"
        )
    if residual is not None and (
        residual.shape != x.shape
        or residual.stride(-1) != 1
        or residual.dtype not in (x.dtype, torch.float32)
    ):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} "
            f"with x's dtype or float32"
        )
    if weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"weight dtype {weight.dtype} must be float32 or x's dtype {x.dtype}")
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            out, x, residual if residual is not None else x, weight,
            out.stride(0), x.stride(0), residual.stride(0) if residual is not None else 0,
            x.shape[1], eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]),
            INTERPRET=interpreting(),
        )  # fmt: skip
    return out, residual

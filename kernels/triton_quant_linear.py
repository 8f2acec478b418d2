"""Weight-only quantized linear layers on CUDA (Triton): ``y = x @ dequantize(W).T + bias``.

One GEMM kernel tiled over (M, N) with a loop over K, reading the packed layout of
``kernels.quant_linear`` (uint4 nibbles, uint8 or float8_e4m3fn bytes, fp32 group scales and
zeros). ``BLOCK_K`` divides ``group_size``, so a K step sees one scale and one zero per row:
the tile is unpacked in registers to ``q - zero`` (a whole number in -255..255, or an fp8
value), which 16-bit x's dtype holds exactly, multiplied with x by ``tl.dot`` (fp32
accumulation), and the step's partial sum scaled per column. A 16-bit x therefore runs on
tensor cores with the exact products of the fp32 reference; only the summation order differs
(about 2e-7 of the largest output at K = 256, before the single rounding to ``out_dtype``).
fp32 x, and fp8 weights with zeros (``q - zero`` not exact in 16 bits), take an IEEE fp32 dot.
Verified against ``quant_linear_reference`` under ``TRITON_INTERPRET=1``
(tests/kernels/test_triton_quant_linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_linear import check_layout
from kernels.triton_common import cast, dot, interpreting


@triton.jit
def _quant_linear_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K / 2] uint8 (uint4) or [N, K] uint8 / float8_e4m3fn
    scales_ptr,  # [N, K / group_size] fp32
    zeros_ptr,  # [N, K / group_size] fp32, or a dummy
    bias_ptr,  # [N], or a dummy
    out_ptr,  # [M, N]
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    WEIGHT_TYPE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    # Columns past N read row N - 1 (never stored): the weight loads need no mask, which the
    # interpreter could not fill for fp8 anyway.
    w_cols = tl.minimum(cols, N - 1).to(tl.int64)
    w_rows = w_ptr + w_cols[:, None] * stride_wn
    s_rows = scales_ptr + w_cols * stride_sn
    z_rows = zeros_ptr + w_cols * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of group_size, group_size of BLOCK_K: no step needs a K mask.
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
        if WEIGHT_TYPE == "uint4":
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + half[None, :])
            # Byte j holds column 2j (low nibble) and 2j + 1 (high): join interleaves them.
            q = tl.join(packed & 0x0F, packed >> 4).reshape(BLOCK_N, BLOCK_K)
        else:  # uint8 or float8_e4m3fn: one element a byte
            q = tl.load(w_rows + ks[None, :])
        w = q.to(tl.float32)
        group = k0 // group_size
        if HAS_ZEROS:
            w -= tl.load(z_rows + group)[:, None]
        if FP32_DOT:
            a = a.to(tl.float32)
        partial = dot(a, tl.trans(w.to(a.dtype)), DOT_PRECISION, INTERPRET)
        acc += partial * tl.load(s_rows + group)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        cast(acc, out_ptr.dtype.element_ty, INTERPRET),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def block_config(m: int, group_size: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``m`` rows of x: narrow N
    tiles for decode (more programs to stream the weight), square ones for prefill. BLOCK_K is
    the largest power of two up to the bucket's that divides ``group_size``."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 32, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    return bm, bn, min(bk, group_size & -group_size), warps, stages


def triton_quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    weight_type: str,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton twin of ``kernels.quant_linear.quant_linear_reference`` for a 2-D ``x`` ``[M, K]``
    (fp32, fp16 or bf16); ``out_dtype`` defaults to x's."""
    n, k = check_layout(qweight, scales, zeros, weight_type, group_size)
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)}: expected [M, {k}]")
    out = x.new_empty(m, n, dtype=out_dtype or x.dtype)
    if m == 0 or n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    bias = None if bias is None else bias.contiguous()
    bm, bn, bk, warps, stages = block_config(m, group_size)
    fp32_dot = x.dtype == torch.float32 or (weight_type == "float8_e4m3fn" and zeros is not None)
    dummy = scales  # never read: HAS_ZEROS / HAS_BIAS are False
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _quant_linear_kernel[grid](
        x, qweight, scales, dummy if zeros is None else zeros, dummy if bias is None else bias,
        out, m, n, k, group_size, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        WEIGHT_TYPE=weight_type, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        FP32_DOT=fp32_dot, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        # fp32 must not silently drop to TF32 (the fp32 accuracy contract); 16-bit ignores it.
        DOT_PRECISION="ieee" if fp32_dot else "tf32",
        INTERPRET=interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out

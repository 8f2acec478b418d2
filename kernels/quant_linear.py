"""Weight-only quantized projections: ``y = x @ dequantize(W).T + bias`` with ``W`` kept packed.

Every checkpoint format pagedq loads (AWQ, GPTQ, compressed-tensors) is converted at load into
one layout, the one these kernels read:

- ``qweight``: ``[N, K / 2]`` uint8 for ``uint4`` (byte ``j`` of row ``n`` holds column
  ``2j`` in its low nibble and ``2j + 1`` in its high nibble), ``[N, K]`` uint8 for ``uint8``,
  ``[N, K]`` float8_e4m3fn for ``float8_e4m3fn``.
- ``scales``: ``[N, K / group_size]`` fp32, one per output row and group of ``group_size``
  consecutive input columns (a channel-wise scheme has ``group_size = K``).
- ``zeros``: ``[N, K / group_size]`` fp32 (whole numbers, the unsigned zero point of each group),
  or None for zero; a symmetric 4-bit scheme stores 8, a symmetric 8-bit one 128.

The weight is ``(q - zero) * scale`` per element, computed in fp32: with fp16 or bf16 scales and
integer ``q`` and ``zero`` every value is exact, so the dequantized weight equals a checkpoint
dequantized offline bit for bit. ``K`` and ``group_size`` are multiples of 32.

The CPU kernel (``quant_linear_cpu.cpp``) and the Triton one (``triton_quant_linear.py``)
unpack in registers and accumulate in fp32; ``quant_linear_reference`` is the torch
definition they are tested against, and ``quant_linear`` picks one of the three.
"""

from __future__ import annotations

import torch

WEIGHT_TYPES = ("uint4", "uint8", "float8_e4m3fn")
WEIGHT_TYPE_CODES = {name: code for code, name in enumerate(WEIGHT_TYPES)}  # the C++ op's ints
GROUP_MULTIPLE = 32
CPU_DTYPES = (torch.float32, torch.bfloat16)  # x and output dtypes of the C++ kernel


def check_layout(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    weight_type: str,
    group_size: int,
) -> tuple[int, int]:
    """``(N, K)`` of a packed weight, or ValueError naming what does not fit the layout."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type={weight_type!r}: must be one of {WEIGHT_TYPES}")
    n, width = qweight.shape
    k = width * 2 if weight_type == "uint4" else width
    expected_dtype = torch.float8_e4m3fn if weight_type == "float8_e4m3fn" else torch.uint8
    if qweight.dtype != expected_dtype:
        raise ValueError(f"qweight dtype {qweight.dtype}: {weight_type} needs {expected_dtype}")
    if group_size <= 0 or group_size % GROUP_MULTIPLE or k % group_size:
        raise ValueError(
            f"group_size={group_size} with in_features={k}: both must be multiples of "
            f"{GROUP_MULTIPLE}, and in_features a multiple of group_size"
        )
    groups = (n, k // group_size)
    if tuple(scales.shape) != groups or scales.dtype != torch.float32:
        raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype}: expected {groups} fp32")
    if zeros is not None and (tuple(zeros.shape) != groups or zeros.dtype != torch.float32):
        raise ValueError(f"zeros {tuple(zeros.shape)} {zeros.dtype}: expected {groups} fp32")
    return n, k


def pack_uint4(values: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in 0..15 as ``[N, K / 2]`` uint8, even columns in the low nibble."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """``pack_uint4``'s inverse: ``[N, K]`` uint8 in 0..15."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    weight_type: str,
    group_size: int,
) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight of a packed one (for references and tests, never the hot
    path)."""
    check_layout(qweight, scales, zeros, weight_type, group_size)
    q = unpack_uint4(qweight) if weight_type == "uint4" else qweight
    q = q.to(torch.float32)
    if zeros is not None:
        q = q - zeros.repeat_interleave(group_size, dim=1)
    return q * scales.repeat_interleave(group_size, dim=1)


def quant_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    weight_type: str,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequantize(W).T + bias`` in fp32, as ``x.dtype``: the definition the kernels
    meet."""
    w = dequantize(qweight, scales, zeros, weight_type, group_size)
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quant_linear_cpu_available() -> bool:
    """True where the C++ kernels (``torch.ops.pagedq.quant_linear``) are built and loaded."""
    from kernels import cpu_attention

    return cpu_attention.cpu_kernels_available() and bool(torch.ops.pagedq.quant_linear_available())


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    weight_type: str,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ dequantize(W).T + bias`` over x ``[..., K]``, rounded once to ``out_dtype`` (x's by
    default): Triton on CUDA, the C++ kernel on CPU, else the torch reference."""
    n, k = check_layout(qweight, scales, zeros, weight_type, group_size)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    out_dtype = out_dtype or x.dtype
    if x.is_cuda:
        from kernels.triton_quant_linear import triton_quant_linear

        out = triton_quant_linear(
            x2d, qweight, scales, zeros, weight_type, group_size, bias, out_dtype
        )
    elif x.dtype in CPU_DTYPES and out_dtype in CPU_DTYPES and quant_linear_cpu_available():
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        out = torch.empty(x2d.shape[0], n, dtype=out_dtype)
        torch.ops.pagedq.quant_linear(
            x2d,
            qweight.contiguous(),
            scales.contiguous(),
            None if zeros is None else zeros.contiguous(),
            WEIGHT_TYPE_CODES[weight_type],
            group_size,
            None if bias is None else bias.float().contiguous(),
            out,
        )
    else:  # fp32 x (exact from fp16/bf16): the output rounded once
        ref = quant_linear_reference(
            x2d.float(), qweight, scales, zeros, weight_type, group_size, bias
        )
        out = ref.to(out_dtype)
    return out.view(*lead, n)

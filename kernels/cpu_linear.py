"""Projections over weights packed once for pagedq's own CPU GEMM (``linear_cpu.cpp``).

oneDNN's prepacked GEMM stalls on its weight loads when they come from DRAM, as in every decode
step; this kernel prefetches each thread's next column block while it computes the current one
(docs/PERFORMANCE.md). It needs an AVX2 (with FMA) or AVX-512 build, bf16 on AVX-512 also
AVX512-BF16 (AVX2 widens bf16 weights in registers); elsewhere ``packed_linear_available`` is
False and the engine keeps oneDNN. Whether it is faster than
oneDNN on a host is measured (engine/dtype_probe.py): with AMX, oneDNN's bf16 is.
"""

from __future__ import annotations

import torch

from kernels import cpu_attention


def packed_linear_available(dtype: torch.dtype) -> bool:
    """True where the C++ kernels are built and this build has the GEMM for ``dtype``."""
    if not cpu_attention.cpu_kernels_available():
        return False
    return bool(torch.ops.pagedq.packed_linear_available(dtype))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (fp32 or bf16) in the kernel's column-block layout."""
    cpu_attention._require()
    return torch.ops.pagedq.pack_linear_weight(weight.detach())


def packed_linear_silu_mul(
    x: torch.Tensor, packed: torch.Tensor, intermediate: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` over gate_up's packed ``[2 * intermediate, in]`` weight
    (``intermediate`` a multiple of 64), with silu_and_mul's arithmetic on the rounded gate and
    up values: the same numbers as the linear and then ``silu_and_mul``, without writing the
    ``[tokens, 2 * intermediate]`` product."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], intermediate, dtype=x.dtype)
    torch.ops.pagedq.packed_linear_silu_mul(x, packed, bias, out)
    return out


ARGMAX_MAX_ROWS = 192  # one pass over the weights (the kernel's kMB)


def packed_linear_argmax(x: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(x @ W.T).argmax(-1)`` (int64, ties and NaN as ``torch.argmax``) of a packed LM head
    without writing the logits, ranked as ``packed_linear(..., out_dtype=float32)`` writes them.
    At most ``ARGMAX_MAX_ROWS`` rows."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    torch.ops.pagedq.packed_linear_argmax(x, packed, vocab, out)
    return out


def unpack_linear_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The plain ``[out, in]`` weight back from ``pack_linear_weight``'s layout (a copy)."""
    blocks, rows, width = packed.shape[:3]
    if packed.dim() == 3:  # fp32: [N/64][K][64]
        plain = packed.permute(0, 2, 1).reshape(blocks * width, rows)
    else:  # bf16: [N/64][K/2][64][2]
        plain = packed.permute(0, 2, 1, 3).reshape(blocks * width, rows * 2)
    return plain[:out_features, :in_features].contiguous()


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` (``bias`` fp32) as ``out_dtype``: x's dtype (rounded once), or fp32
    (the fp32 sums as they are, also of bf16 products: logits without bf16's ties)."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=out_dtype or x.dtype)
    torch.ops.pagedq.packed_linear(x, packed, bias, out)
    return out.view(*lead, out_features)

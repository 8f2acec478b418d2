"""Linear layers whose weights are reordered once into oneDNN's blocked layout (CPU).

A plain ``F.linear`` re-reads the ``[out, in]`` weight in whatever order the GEMM wants on every
call; oneDNN's prepacked layout is the order its kernel streams. In fp32 that measured 15-45%
faster per projection and about 2x on the 49152-row LM head; in bf16 on a CPU with AMX, 1.2-1.6x
per step's projections (docs/PERFORMANCE.md). The numbers differ from ``F.linear`` only by
summation order.

A bf16 weight on a CPU without AMX is packed widened to fp32 (exactly) and its products run in
fp32, the output rounded to bf16: what a bf16 GEMM computes (bf16 inputs, fp32 sums), at fp32's
speed. There oneDNN's own bf16 products are emulated (AVX2: plain bf16 ``F.linear`` took 2.4x
the time of packed fp32) or slower than fp32 (AVX512-BF16 alone: 1.3-1.6x).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.cpu_features import cpu_has_amx

# PAGEDQ_PREPACK=0 keeps plain F.linear (for comparisons in bench/roofline.py).
PREPACK_DTYPES = (torch.float32, torch.bfloat16)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where prepacked oneDNN linears are used: CPU, fp32 or bf16, oneDNN built in, not
    disabled."""
    return (
        device.type == "cpu"
        and dtype in PREPACK_DTYPES
        and os.environ.get("PAGEDQ_PREPACK", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def widens_bf16() -> bool:
    """True where bf16 weights are packed widened to fp32: CPUs without AMX."""
    return not cpu_has_amx()


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held only in oneDNN's layout; ``y`` in ``out_dtype``
    (default: the weight's dtype)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.out_dtype = out_dtype or weight.dtype
        widen = weight.dtype == torch.bfloat16 and widens_bf16()
        self.compute_dtype = torch.float32 if widen else weight.dtype
        with torch.no_grad():
            plain = weight.detach().to(self.compute_dtype).contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(plain)
        self.bias = None if bias is None else bias.detach().to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y.to(self.out_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain ``[out, in]`` tensor (a fresh copy: for inspection, not speed)."""
        return self.packed.to_dense().to(self.dtype)


def pack(linear: nn.Linear, out_dtype: torch.dtype | None = None) -> PackedLinear:
    """The prepacked twin of ``linear``."""
    return PackedLinear(linear.weight, linear.bias, out_dtype)

"""Linear layers whose weights are reordered once into oneDNN's blocked layout (CPU).

A plain ``F.linear`` re-reads the ``[out, in]`` weight in whatever order the GEMM wants on every
call; oneDNN's prepacked layout is the order its kernel streams. In fp32 that measured 15-45%
faster per projection and about 2x on the 49152-row LM head; in bf16 on a CPU with AMX, 1.2-1.6x
per step's projections (docs/PERFORMANCE.md). The numbers differ from ``F.linear`` only by
summation order.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.cpu_features import cpu_has_amx

# PAGEDQ_PREPACK=0 keeps plain F.linear (for comparisons in bench/roofline.py).
PREPACK_DTYPES = (torch.float32, torch.bfloat16)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where prepacked oneDNN linears are used: CPU, fp32 (or bf16 with AMX), oneDNN built
    in, not disabled."""
    return (
        device.type == "cpu"
        and dtype in PREPACK_DTYPES
        and (dtype != torch.bfloat16 or cpu_has_amx())
        and os.environ.get("PAGEDQ_PREPACK", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held only in oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain ``[out, in]`` tensor (a fresh copy: for inspection, not speed)."""
        return self.packed.to_dense()


def pack(linear: nn.Linear) -> PackedLinear:
    """The prepacked twin of ``linear``."""
    return PackedLinear(linear.weight, linear.bias)

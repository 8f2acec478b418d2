"""Linear layers whose weights are reordered once into a GEMM's packed layout (CPU).

A plain ``F.linear`` re-reads the ``[out, in]`` weight in whatever order the GEMM wants on every
call; a prepacked layout is the order the kernel streams. In fp32 oneDNN's measured 15-45%
faster per projection and about 2x on the 49152-row LM head; in bf16 on a CPU with AMX, 1.2-1.6x
per step's projections (docs/PERFORMANCE.md). The numbers differ from ``F.linear`` only by
summation order.

Two GEMMs run the packed weights: oneDNN's, or pagedq's own AVX-512 one
(``kernels/cpu_linear.py``), which overlaps the weights' DRAM reads with its products where
oneDNN waits on them (a Zen 4 host: 0.85x the time of a layer's projections at batch 64, 0.4-0.7x
at batch 1-16; with AMX oneDNN's bf16 stays ahead). This module takes the GEMM and the compute
dtype as given; which one a host should use is measured by ``engine/dtype_probe.py`` and applied
by ``engine/models/packed_linear.py``.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

# PAGEDQ_PREPACK=0 keeps plain F.linear (for comparisons in bench/roofline.py).
PREPACK_DTYPES = (torch.float32, torch.bfloat16)
GEMMS = ("onednn", "pagedq")


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where prepacked linears are used: CPU, fp32 or bf16, oneDNN built in, not
    disabled."""
    return (
        device.type == "cpu"
        and dtype in PREPACK_DTYPES
        and os.environ.get("PAGEDQ_PREPACK", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """True where oneDNN reorders a ``dtype`` weight on this CPU: its bf16 layout needs
    AVX512-BW/VL/DQ or AVX-NE-CONVERT, which an AVX2 host (AMD Zen 2 and 3) lacks."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pagedq_gemm_available(dtype: torch.dtype) -> bool:
    """True where pagedq's own GEMM is built for ``dtype`` (AVX2 or AVX-512; bf16 on AVX-512:
    AVX512-BF16)."""
    from kernels.cpu_linear import packed_linear_available

    return packed_linear_available(dtype)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held only in a GEMM's packed layout; ``y`` in
    ``out_dtype`` (default: the weight's dtype). A bf16 weight is widened to fp32 where
    ``widen``; ``gemm`` is "onednn" or "pagedq" (oneDNN where pagedq's is not built)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        widen: bool = False,
        gemm: str = "onednn",
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.out_dtype = out_dtype or weight.dtype
        widen = widen and weight.dtype == torch.bfloat16
        self.compute_dtype = torch.float32 if widen else weight.dtype
        if gemm not in GEMMS:
            raise ValueError(f"gemm={gemm!r} is not supported: must be one of {GEMMS}")
        if gemm == "pagedq" and not pagedq_gemm_available(self.compute_dtype):
            gemm = "onednn"
        if gemm == "onednn" and not onednn_packs(self.compute_dtype):
            # No bf16 layout of oneDNN's on this CPU: widened, the same numbers at fp32's speed.
            self.compute_dtype = torch.float32
        self.gemm = gemm
        with torch.no_grad():
            plain = weight.detach().to(self.compute_dtype).contiguous()
            if gemm == "pagedq":
                from kernels.cpu_linear import pack_linear_weight

                self.packed = pack_linear_weight(plain)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(plain)
        # pagedq's GEMM adds an fp32 bias before its one rounding; oneDNN takes the compute dtype.
        bias_dtype = torch.float32 if gemm == "pagedq" else self.compute_dtype
        self.bias = None if bias is None else bias.detach().to(bias_dtype).contiguous()
        self._to_out = self.out_dtype != self.compute_dtype and not (
            gemm == "pagedq" and self.out_dtype == torch.float32
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tensor.to costs ~8 us even when it has nothing to do: 240 such calls a step.
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.gemm == "pagedq":
            from kernels.cpu_linear import packed_linear

            out_dtype = torch.float32 if self.out_dtype == torch.float32 else self.compute_dtype
            y = packed_linear(x, self.packed, self.out_features, self.bias, out_dtype)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y.to(self.out_dtype) if self._to_out else y

    @property
    def fuses_silu_and_mul(self) -> bool:
        """True where `silu_and_mul` runs fused in the GEMM: pagedq's, not widened, gate and up
        halves in whole column blocks (a multiple of 64 features each)."""
        half = self.out_features // 2
        return (
            self.gemm == "pagedq"
            and self.compute_dtype == self.dtype == self.out_dtype
            and self.out_features == 2 * half
            and half % 64 == 0
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this gate_up projection, the same numbers as
        ``kernels.silu_and_mul(self(x))`` (requires `fuses_silu_and_mul`)."""
        from kernels.cpu_linear import packed_linear_silu_mul

        return packed_linear_silu_mul(x, self.packed, self.out_features // 2, self.bias)

    def fuses_argmax(self, rows: int) -> bool:
        """True where `argmax` runs in the GEMM for ``rows`` rows: a bias-free LM head (fp32
        logits) on pagedq's GEMM, within one pass over its weights."""
        from kernels.cpu_linear import ARGMAX_MAX_ROWS

        return (
            self.gemm == "pagedq"
            and self.out_dtype == torch.float32
            and self.bias is None
            and 0 < rows <= ARGMAX_MAX_ROWS
        )

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).argmax(-1)`` without the logits (requires `fuses_argmax`)."""
        from kernels.cpu_linear import packed_linear_argmax

        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        return packed_linear_argmax(x, self.packed, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain ``[out, in]`` tensor (a fresh copy: for inspection, not speed)."""
        if self.gemm == "pagedq":
            from kernels.cpu_linear import unpack_linear_weight

            return unpack_linear_weight(self.packed, self.out_features, self.in_features).to(
                self.dtype
            )
        return self.packed.to_dense().to(self.dtype)

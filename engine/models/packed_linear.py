"""Prepacked linears as this host measured fastest: the dtype probe's choices applied.

``kernels/packed_linear.py`` runs a packed weight on a given GEMM and compute dtype; this module
fills those in from ``engine/dtype_probe.py``: a bf16 weight is packed in bf16 where bf16
products are faster than fp32 ones on this host (AMX: 0.18x; a Zen 4 with AVX512-BF16:
0.51-0.54x), and widened to fp32 (exactly) where they are not (AVX2: emulated, 2.4x; an Intel
host with AVX512-BF16 alone: 1.3-1.6x): its products then run in fp32, the output rounded to
bf16, what a bf16 GEMM computes at fp32's speed. The probe imports only ``kernels``, so the two
modules no longer import each other.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from engine.dtype_probe import probe_cpu_dtype
from kernels.packed_linear import GEMMS, PREPACK_DTYPES, pagedq_gemm_available, prepack_supported
from kernels.packed_linear import PackedLinear as _PackedLinear

__all__ = [
    "GEMMS",
    "PREPACK_DTYPES",
    "PackedLinear",
    "forced_gemm",
    "measured_gemm",
    "pack",
    "pagedq_gemm_available",
    "prepack_supported",
    "widens_bf16",
]


def widens_bf16() -> bool:
    """True where bf16 weights are packed widened to fp32: hosts where that measured faster
    than oneDNN's bf16 products (the cached probe of engine/dtype_probe.py)."""
    return probe_cpu_dtype().widen_bf16


def forced_gemm() -> str | None:
    """The GEMM ``PAGEDQ_GEMM`` names ("onednn" or "pagedq"), or None when it is unset."""
    forced = os.environ.get("PAGEDQ_GEMM", "")
    if forced and forced not in GEMMS:
        raise ValueError(f"PAGEDQ_GEMM={forced!r} is not supported: must be one of {GEMMS}")
    return forced or None


def measured_gemm(dtype: torch.dtype) -> str:
    """ "pagedq" where this host measured pagedq's GEMM faster than oneDNN's for ``dtype`` (the
    compute dtype), else "onednn"; ``PAGEDQ_GEMM=onednn`` or ``=pagedq`` overrides."""
    forced = forced_gemm()
    if forced:
        return forced
    probe = probe_cpu_dtype()
    return probe.gemm_bf16 if dtype == torch.bfloat16 else probe.gemm_fp32


class PackedLinear(_PackedLinear):
    """A packed linear whose ``widen`` and ``gemm`` default to what this host measured."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        widen: bool | None = None,
        gemm: str | None = None,
    ) -> None:
        if out_dtype == torch.float32 and weight.dtype == torch.bfloat16 and widen is None:
            # fp32 outputs of bf16 products (the LM head) are the fp32 sums, never rounded to
            # bf16: pagedq's GEMM writes them so; oneDNN's bf16 would round, so it widens.
            if gemm is None:
                gemm = forced_gemm() or "pagedq"
            widen = gemm != "pagedq" or not pagedq_gemm_available(torch.bfloat16)
        if widen is None:
            widen = weight.dtype == torch.bfloat16 and widens_bf16()
        if gemm is None:
            gemm = measured_gemm(torch.float32 if widen else weight.dtype)
        super().__init__(weight, bias, out_dtype, widen, gemm)


def pack(linear: nn.Linear, out_dtype: torch.dtype | None = None) -> PackedLinear:
    """The prepacked twin of ``linear``."""
    return PackedLinear(linear.weight, linear.bias, out_dtype)

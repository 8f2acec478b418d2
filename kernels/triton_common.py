"""Helpers shared by the Triton kernels, mostly to keep the CPU interpreter faithful to a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) multiplies bf16 dot
operands as raw uint16 bits and truncates fp32 -> bf16 casts, where a GPU rounds to nearest even.
Kernels take an ``INTERPRET`` constexpr and route those two operations through here.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # Triton before knobs
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; exact upcast on the interpreter."""
    if INTERPRET:
        # bf16 products fit fp32 exactly, so this is what tensor cores compute.
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PRECISION)
    return c


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)``, rounding fp32 -> bf16 to nearest even on the interpreter too."""
    y = x.to(dtype)
    # Nested rather than chained `and`: older Triton front ends reject boolean chains.
    if INTERPRET:
        if dtype == tl.bfloat16:
            if x.dtype == tl.float32:
                bits = x.to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y

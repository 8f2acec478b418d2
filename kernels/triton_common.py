"""Pieces shared by the Triton attention kernels, and helpers that keep the interpreter faithful.

``attend_tiles`` (the online-softmax inner loop) and ``tile_config`` serve both the unified
kernel (``triton_attention``) and the split-K decode (``triton_split_decode``).

Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) multiplies bf16 dot
operands as raw uint16 bits and truncates fp32 -> bf16 casts, where a GPU rounds to nearest even.
Kernels take an ``INTERPRET`` constexpr and route those two operations through here.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


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


@triton.jit
def attend_tiles(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr, stride_bn, kv_head,
    stride_cb, stride_cs, stride_ch, stride_cd, key_start, key_end, query_pos, dim_mask, qk_scale,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Online softmax (base 2, fp32) of ``q`` over keys ``key_start..key_end-1``."""
    dims = tl.arange(0, HEAD_PAD)
    for tile_start in range(key_start, key_end, TILE_N):
        key_pos = tile_start + tl.arange(0, TILE_N)
        key_mask = key_pos < key_end
        # A tile may span several cache blocks, so each key looks up its own block.
        block = tl.load(
            block_table_row_ptr + (key_pos // BLOCK_SIZE) * stride_bn, mask=key_mask, other=0
        )
        kv_off = block.to(tl.int64) * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs
        kv_off += kv_head * stride_ch
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None] * stride_cd,
            mask=key_mask[None, :] & dim_mask[:, None],
            other=0.0,
        ).to(q.dtype)
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + dims[None, :] * stride_cd,
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        ).to(q.dtype)
        s = dot(q, k, DOT_PRECISION, INTERPRET) * qk_scale
        visible = key_mask[None, :] & (key_pos[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key yet keep m = -inf; shift them by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERPRET), v, DOT_PRECISION, INTERPRET)
        m_i = m_new
    return acc, l_i, m_i


def tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, str]:
    """``(HEAD_PAD, TILE_N, DOT_PRECISION)``: pow2 head padding, keys per tile, dot precision."""
    head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16
    # fp32 must not silently drop to TF32, which would miss the fp32 accuracy contract.
    return head_pad, 32 if head_pad <= 128 else 16, "ieee" if dtype == torch.float32 else "tf32"

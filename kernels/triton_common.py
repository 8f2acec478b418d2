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
def tanh(x):
    """tanh in fp32: -expm1(-2|x|) / (2 + expm1(-2|x|)) with the sign of x; near 0 expm1 is its
    Taylor polynomial (1 - e^-2|x| would cancel there). Relative error about 2e-7."""
    a = tl.abs(x)
    r = a * -2.0
    q = r * (1.0 / 5040.0) + 1.0 / 720.0
    q = q * r + 1.0 / 120.0
    q = q * r + 1.0 / 24.0
    q = q * r + 1.0 / 6.0
    q = q * r + 0.5
    small = r * (q * r + 1.0)
    large = tl.exp2(r * 1.4426950408889634) - 1.0
    em1 = tl.where(a < 0.1733, small, large)
    t = -em1 / (em1 + 2.0)
    return tl.where(x < 0, -t, t)


@triton.jit
def attend_tiles(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, block_table_row_ptr, stride_bn, kv_head,
    stride_cb, stride_cs, stride_ch, stride_cd, key_start, key_end, query_pos, dim_mask, qk_scale,
    window, soft_cap, slopes,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_ALIBI: tl.constexpr,
):  # fmt: skip
    """Online softmax (base 2, fp32) of ``q`` over keys ``key_start..key_end-1``.

    ``USE_WINDOW``: row r sees keys above ``query_pos[r] - window`` only. ``USE_SOFT_CAP``:
    scores (q . k x ``qk_scale``) become ``soft_cap * tanh(scores)`` (``soft_cap`` in log2 units,
    ``qk_scale`` then scale / cap). ``USE_ALIBI``: row r's scores gain
    ``slopes[r] * (key - query_pos[r])`` (``slopes`` in log2 units) after that.
    """
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
        if USE_SOFT_CAP:
            s = soft_cap * tanh(s)
        if USE_ALIBI:
            s += slopes[:, None] * (key_pos[None, :] - query_pos[:, None]).to(tl.float32)
        visible = key_mask[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
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


@triton.jit
def load_slopes(alibi_ptr, head, row_mask, HAS_ALIBI: tl.constexpr):
    """Each row's ALiBi slope (natural-log units at ``alibi_ptr + head``) in log2 units, or
    zeros without ALiBi."""
    slopes = tl.zeros(head.shape, tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + head, mask=row_mask, other=0.0).to(tl.float32)
        slopes = slopes * 1.4426950408889634
    return slopes


@triton.jit
def join_sinks(acc, l_i, m_i, sinks_ptr, head, row_mask):
    """The online-softmax state with each row's sink logit (natural log units, at
    ``sinks_ptr + head``) joined to its denominator: a key of score sink and value 0."""
    sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_new), m_new


def option_args(
    scale: float, sliding_window: int | None, logits_soft_cap: float | None
) -> tuple[float, int, float]:
    """``(qk_scale, window, soft_cap)`` the kernels take: the score factor (with a soft cap,
    scale / cap before the tanh), the window (0: none), the cap in log2 units (0: none)."""
    if logits_soft_cap:
        return scale / logits_soft_cap, sliding_window or 0, logits_soft_cap * LOG2E
    return scale * LOG2E, sliding_window or 0, 0.0


def tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, str]:
    """``(HEAD_PAD, TILE_N, DOT_PRECISION)``: pow2 head padding, keys per tile, dot precision."""
    head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16
    # fp32 must not silently drop to TF32, which would miss the fp32 accuracy contract.
    return head_pad, 32 if head_pad <= 128 else 16, "ieee" if dtype == torch.float32 else "tf32"

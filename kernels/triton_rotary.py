"""Rotary position embedding (Neox/Llama "rotate half" layout) for q and k in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import rotary_torch  # noqa: F401  (the oracle, re-exported)
from kernels.triton_common import cast, interpreting


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, token, cos, sin, num_heads, HALF: tl.constexpr,
            HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    lo_ptr = x_ptr + token * stride_t + heads * stride_h + dims
    lo = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(lo_ptr, cast(lo * cos - hi * sin, dtype, INTERPRET), mask=mask)
    tl.store(lo_ptr + HALF, cast(hi * cos + lo * sin, dtype, INTERPRET), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    # Match the reference, which casts cos/sin to the activation dtype before use.
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_cache + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cache + dims, mask=dims < HALF, other=0.0)
    cos = cast(cos, dtype, INTERPRET).to(tl.float32)
    sin = cast(sin, dtype, INTERPRET).to(tl.float32)
    _rotate(q_ptr, stride_qt, stride_qh, token, cos, sin, num_heads, HALF, Q_HEADS_PAD, HALF_PAD,
            INTERPRET)  # fmt: skip
    _rotate(k_ptr, stride_kt, stride_kh, token, cos, sin, num_kv_heads, HALF, K_HEADS_PAD,
            HALF_PAD, INTERPRET)  # fmt: skip


def rotary_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``rotary_torch``; rotates ``query`` and ``key`` in place and returns them."""
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or head_dim % 2 or cos_cache.shape[-1] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and cos/sin cache "
            f"{tuple(cos_cache.shape)} need one even head_dim"
        )
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_cache.stride() != sin_cache.stride():
        raise ValueError("query, key and the cos/sin caches need unit stride on head_dim")
    if query.shape[0]:
        half = head_dim // 2
        _rotary_kernel[(query.shape[0],)](
            query, key, positions, cos_cache, sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0),
            query.shape[1], key.shape[1],
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            Q_HEADS_PAD=triton.next_power_of_2(query.shape[1]),
            K_HEADS_PAD=triton.next_power_of_2(key.shape[1]), INTERPRET=interpreting(),
        )  # fmt: skip
    return query, key

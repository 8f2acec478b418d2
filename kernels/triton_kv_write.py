"""Triton kernel: scatter the new tokens' K/V into the paged cache by ``slot_mapping``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast, interpreting


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token of a padded batch
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + src * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims * stride_cd
    tl.store(k_cache_ptr + dst, cast(k, k_cache_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(v_cache_ptr + dst, cast(v, v_cache_ptr.dtype.element_ty, INTERPRET), mask=mask)


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton twin of ``write_kv_torch``: one program per token, slots of -1 skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    if kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} does not fit key {tuple(key.shape)}: expected "
            "[2, num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        INTERPRET=interpreting(),
    )

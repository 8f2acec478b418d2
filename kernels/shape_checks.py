"""The argument checks a kernel's reference and its Triton twin share (one module both import,
so neither imports the other's private names).

``check_latent_cache`` for multi-head latent attention (kernels/mla.py, triton_mla.py),
``check_gated_delta`` for the gated delta rule (gated_delta.py, triton_gated_delta.py),
``check_causal_conv1d`` for the short convolution (causal_conv1d.py, triton_causal_conv1d.py).
"""

from __future__ import annotations

import torch

CONV_ACTIVATIONS = (None, "silu")


def check_latent_cache(
    latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor
) -> None:
    """``latent_cache`` is ``[num_blocks, block_size, kv_lora_rank + rope_dim]``."""
    width = latent.shape[-1] + k_pe.shape[-1]
    if latent_cache.dim() != 3 or latent_cache.shape[2] != width:
        raise ValueError(f"latent_cache {tuple(latent_cache.shape)} must be [num_blocks, "
                         f"block_size, kv_lora_rank + rope_dim = {width}]")  # fmt: skip


def check_gated_delta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
) -> None:  # fmt: skip
    """q, k ``[T, k_heads, k_dim]``, v ``[T, v_heads, v_dim]``, g and beta ``[T, v_heads]``, the
    state pool and one slot per sequence agree."""
    num_tokens, num_k_heads, k_dim = q.shape
    _, num_v_heads, v_dim = v.shape
    if k.shape != q.shape or v.shape[0] != num_tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of {num_k_heads=}")
    if g.shape != (num_tokens, num_v_heads) or beta.shape != g.shape:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be "
                         f"[num_tokens, num_v_heads] = {(num_tokens, num_v_heads)}")  # fmt: skip
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (num_v_heads, k_dim, v_dim):
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be [num_slots, "
                         f"{num_v_heads}, {k_dim}, {v_dim}]")  # fmt: skip
    if state_indices.shape != (query_start_loc.shape[0] - 1,):
        raise ValueError("state_indices must hold one slot per sequence of query_start_loc")


def check_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor, activation: str | None
) -> None:
    """x ``[T, dim]``, weight ``[dim, kernel_size]``, the pool ``[slots, dim, kernel_size - 1]``."""
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must be [num_tokens, dim] and weight "
                         f"{tuple(weight.shape)} [dim, kernel_size]")  # fmt: skip
    want = (x.shape[1], weight.shape[1] - 1)
    if conv_state_pool.dim() != 3 or tuple(conv_state_pool.shape[1:]) != want:
        raise ValueError(f"conv_state_pool {tuple(conv_state_pool.shape)} must be "
                         f"[num_slots, {want[0]}, {want[1]}]")  # fmt: skip

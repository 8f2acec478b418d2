"""The argument checks a kernel's reference and its Triton twin share (one module both import,
so neither imports the other's private names).

``check_latent_cache`` for multi-head latent attention (kernels/mla.py, triton_mla.py),
``check_gated_delta`` for the gated delta rule (gated_delta.py, triton_gated_delta.py),
``check_causal_conv1d`` for the short convolution (causal_conv1d.py, triton_causal_conv1d.py),
``check_kimi_delta`` for Kimi Delta Attention (kimi_delta.py, triton_kimi_delta.py),
``check_mamba_ssm`` for the Mamba-2 scan (mamba_ssm.py, triton_mamba_ssm.py); the last three
share ``check_state_slots`` (the state pool and one slot per sequence).
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
    check_state_slots(state_pool, (num_v_heads, k_dim, v_dim), query_start_loc, state_indices)


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


def check_kimi_delta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
) -> None:  # fmt: skip
    """q, k and g ``[T, heads, k_dim]``, v ``[T, heads, v_dim]``, beta ``[T, heads]``, the state
    pool and one slot per sequence agree (Kimi Delta Attention: one head count for all)."""
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)} and v {tuple(v.shape)} must be 3-d "
                         "[num_tokens, num_heads, dim]")  # fmt: skip
    num_tokens, num_heads, k_dim = q.shape
    v_dim = v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v {tuple(v.shape)} must be [num_tokens, num_heads, v_dim] with "
                         f"{(num_tokens, num_heads)} from q")  # fmt: skip
    if g.shape != q.shape:
        raise ValueError(f"g {tuple(g.shape)} must be [num_tokens, num_heads, k_dim] = "
                         f"{tuple(q.shape)}")  # fmt: skip
    if beta.shape != (num_tokens, num_heads):
        raise ValueError(f"beta {tuple(beta.shape)} must be [num_tokens, num_heads] = "
                         f"{(num_tokens, num_heads)}")  # fmt: skip
    check_state_slots(state_pool, (num_heads, k_dim, v_dim), query_start_loc, state_indices)


def check_mamba_ssm(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, dt_bias: torch.Tensor | None, state_pool: torch.Tensor,
    query_start_loc: torch.Tensor, state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """x ``[T, heads, head_dim]``, dt ``[T, heads]``, A ``[heads]`` (Mamba-2) or ``[heads,
    state_dim]`` (Mamba-1), D and dt_bias ``[heads]``, B and C ``[T, groups, state_dim]`` (heads
    a multiple of groups), the state pool ``[slots, heads, head_dim, state_dim]`` and one slot
    per sequence agree."""
    if x.dim() != 3:
        raise ValueError(f"x {tuple(x.shape)} must be [num_tokens, num_heads, head_dim]")
    num_tokens, num_heads, head_dim = x.shape
    if dt.shape != (num_tokens, num_heads):
        raise ValueError(f"dt {tuple(dt.shape)} must be [num_tokens, num_heads] = "
                         f"{(num_tokens, num_heads)}")  # fmt: skip
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (num_heads,):
            raise ValueError(f"{name} {tuple(v.shape)} must be [num_heads] = ({num_heads},)")
    if B.dim() == 3 and A.shape not in ((num_heads,), (num_heads, B.shape[2])):
        raise ValueError(f"A {tuple(A.shape)} must be [num_heads] = ({num_heads},) or "
                         f"[num_heads, state_dim] = ({num_heads}, {B.shape[2]})")  # fmt: skip
    if B.dim() != 3 or B.shape[0] != num_tokens or B.shape[1] == 0 or num_heads % B.shape[1]:
        raise ValueError(f"B {tuple(B.shape)} must be [num_tokens, num_groups, state_dim] with "
                         f"num_heads={num_heads} a multiple of num_groups")  # fmt: skip
    if C.shape != B.shape:
        raise ValueError(f"C {tuple(C.shape)} must match B {tuple(B.shape)}")
    check_state_slots(state_pool, (num_heads, head_dim, B.shape[2]), query_start_loc,
                      state_indices, has_initial_state)  # fmt: skip


def check_state_slots(
    state_pool: torch.Tensor, state_shape: tuple[int, int, int], query_start_loc: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The state pool is ``[num_slots, *state_shape]``; ``state_indices`` (and
    ``has_initial_state`` where given) hold one entry per sequence of ``query_start_loc``."""
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != state_shape:
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be [num_slots, "
                         f"{', '.join(map(str, state_shape))}]")  # fmt: skip
    if query_start_loc.dim() != 1 or state_indices.shape != (query_start_loc.shape[0] - 1,):
        raise ValueError(f"state_indices {tuple(state_indices.shape)} must hold one slot per "
                         f"sequence of query_start_loc {tuple(query_start_loc.shape)}")  # fmt: skip
    if has_initial_state is not None and has_initial_state.shape != state_indices.shape:
        raise ValueError(f"has_initial_state {tuple(has_initial_state.shape)} must be "
                         f"[num_seqs] = {tuple(state_indices.shape)}")  # fmt: skip

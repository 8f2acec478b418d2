"""Attention and KV-cache kernels: Triton on CUDA, a torch reference everywhere else.

Each entry point takes ``backend="auto"|"triton"|"torch"``; "auto" picks Triton when the
tensors live on a CUDA device and Triton imports, and the torch reference otherwise.
"""

from __future__ import annotations

import torch

from kernels.reference import unified_attention_torch, write_kv_torch

BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    """True when the triton package imports."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def select_backend(device: torch.device | str, backend: str = "auto") -> str:
    """Resolve ``backend`` for tensors on ``device`` to "triton" or "torch"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Write K/V ``[num_tokens, num_kv_heads, head_dim]`` into the paged cache by slot."""
    if select_backend(key.device, backend) == "triton":
        from kernels.triton_kv_write import write_kv_triton

        return write_kv_triton(key, value, kv_cache, slot_mapping)
    return write_kv_torch(key, value, kv_cache, slot_mapping)


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal paged attention over a mixed prefill/decode varlen batch."""
    if select_backend(query.device, backend) == "triton":
        from kernels.triton_attention import unified_attention_triton

        return unified_attention_triton(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale, out
        )
    return unified_attention_torch(
        query, kv_cache, query_start_loc, seq_lens, block_table, scale, out
    )


__all__ = ["BACKENDS", "select_backend", "triton_available", "unified_attention", "write_kv"]

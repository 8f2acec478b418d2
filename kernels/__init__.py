"""Attention and KV-cache kernels: Triton on CUDA, C++ on the CPU, a torch reference everywhere.

Each entry point takes ``backend="auto"|"triton"|"cpu"|"torch"``; "auto" picks Triton when the
tensors live on a CUDA device and Triton imports, the C++ CPU kernels (``kernels.cpu_attention``,
built at first use) for CPU tensors when a compiler is there, and the torch reference otherwise.
"""

from __future__ import annotations

import torch

from kernels import cpu_attention
from kernels.attention_options import check_options, has_options
from kernels.huge_pages import zeros_huge
from kernels.reference import (
    AttentionPlan,
    apply_token_bitmask_torch,
    build_plan,
    rms_norm_torch,
    rotary_apply_torch,
    silu_and_mul_torch,
    unified_attention_torch,
    write_kv_torch,
)

BACKENDS = ("auto", "triton", "cpu", "torch")


def triton_available() -> bool:
    """True when the triton package imports."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def select_backend(device: torch.device | str, backend: str = "auto") -> str:
    """Resolve ``backend`` for tensors on ``device`` to "triton", "cpu" or "torch".

    "auto" on a CPU builds (or loads) the C++ kernels; without a compiler it warns once and
    gives "torch". An explicit "cpu" that cannot be built raises instead.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cpu" and not cpu_attention.cpu_kernels_available():
        raise RuntimeError(
            "attention_backend='cpu' is unavailable: "
            f"{cpu_attention.unavailable_reason()}; use 'auto' or 'torch'"
        )
    if backend != "auto":
        return backend
    device_type = torch.device(device).type
    if device_type == "cuda":
        return "triton" if triton_available() else "torch"
    if device_type == "cpu" and cpu_attention.cpu_kernels_available():
        return "cpu"
    return "torch"


def _cpu_fits(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    # fp16 (or any other dtype) on the CPU stays on the reference.
    return cpu_attention.supports(query.dtype, kv_cache.dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Write K/V ``[num_tokens, num_kv_heads, head_dim]`` into the paged cache by slot."""
    chosen = select_backend(key.device, backend)
    if chosen == "triton":
        from kernels.triton_kv_write import write_kv_triton

        return write_kv_triton(key, value, kv_cache, slot_mapping)
    if chosen == "cpu" and _cpu_fits(key, kv_cache):
        return cpu_attention.write_kv_cpu(key, value, kv_cache, slot_mapping)
    return write_kv_torch(key, value, kv_cache, slot_mapping)


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str = "auto",
) -> torch.Tensor:
    """A zeroed paged KV cache of one layer, ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]``.

    For the C++ CPU kernels the storage is head-major inside each block (a view of
    ``[2, num_blocks, num_kv_heads, block_size, head_dim]``), so that the K (or V) of one head
    in one block is a contiguous run of ``block_size * head_dim`` elements: a decode then reads
    whole 4 KiB pages in order instead of 256-byte pieces at a stride, which the hardware
    prefetchers follow better (docs/PERFORMANCE.md). Its memory is on transparent huge pages
    where Linux gives them (``kernels.huge_pages``). Every backend indexes the cache through its
    strides, so the shape is the same either way.
    """
    if select_backend(device, backend) == "cpu":
        storage = (2, num_blocks, num_kv_heads, block_size, head_dim)
        return zeros_huge(storage, dtype).transpose(2, 3)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def plan_attention(
    backend: str,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> AttentionPlan | None:
    """The per-step plan ``backend`` wants (the reference's decode groups), or None.

    Build it once per step and pass it to every layer's ``unified_attention(plan=...)``.
    """
    if backend == "torch":
        return build_plan(query_start_loc, seq_lens, block_table, block_size)
    return None


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention over a mixed prefill/decode varlen batch.

    ``sliding_window``, ``sinks``, ``logits_soft_cap`` and ``alibi_slopes`` are
    ``kernels.attention_options``; None (the default) is plain causal attention.
    """
    chosen = select_backend(query.device, backend)
    options = has_options(sliding_window, sinks, logits_soft_cap, alibi_slopes)
    if options:
        check_options(sliding_window, sinks, logits_soft_cap, query.shape[1], alibi_slopes)
    if chosen == "triton":
        from kernels.triton_attention import unified_attention_triton

        return unified_attention_triton(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale, out,
            sliding_window=sliding_window, sinks=sinks, logits_soft_cap=logits_soft_cap,
            alibi_slopes=alibi_slopes,
        )  # fmt: skip
    if chosen == "cpu" and _cpu_fits(query, kv_cache):
        return cpu_attention.unified_attention_cpu(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale, out,
            sliding_window=sliding_window, sinks=sinks, logits_soft_cap=logits_soft_cap,
            alibi_slopes=alibi_slopes,
        )  # fmt: skip
    return unified_attention_torch(
        query, kv_cache, query_start_loc, seq_lens, block_table, scale, out, plan,
        sliding_window, sinks, logits_soft_cap, alibi_slopes,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x + residual) * weight, x + residual)``; without a residual ``(norm(x), None)``.

    ``weight`` and ``residual`` are each fp32 or x's dtype; the sum is kept in the residual's,
    the norm and its scale run in fp32, rounded once to x's. On the CPU backend the sum is
    written into ``residual`` in place (one pass); elsewhere the torch reference runs.
    """
    if (
        select_backend(x.device, backend) == "cpu"
        and _cpu_fits(x, x)
        and x.stride(-1) == 1
        and weight.dtype in (x.dtype, torch.float32)
        and (residual is None or residual.dtype in (x.dtype, torch.float32))
    ):
        return cpu_attention.rms_norm_cpu(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """``x`` ``[T, heads, D]`` rotated by a step's ``cos``/``signed_sin`` ``[T, 1, D]``.

    On the CPU backend ``x`` is rotated in place (one pass, no copies) and returned; elsewhere a
    new tensor. Bit for bit the reference either way.
    """
    if (
        select_backend(x.device, backend) == "cpu"
        and _cpu_fits(x, x)
        and x.stride(-1) == 1
        and cos.dtype == signed_sin.dtype == x.dtype
        and cos.stride(-1) == 1
    ):
        return cpu_attention.rotary_cpu(x, cos, signed_sin)
    return rotary_apply_torch(x, cos, signed_sin)


def silu_and_mul(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``x`` ``[T, 2d]`` (gate first), as ``[T, d]``."""
    if select_backend(x.device, backend) == "cpu" and _cpu_fits(x, x) and x.stride(-1) == 1:
        return cpu_attention.silu_and_mul_cpu(x)
    return silu_and_mul_torch(x)


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, backend: str = "auto"
) -> None:
    """Forbid (-inf, in place) every token of fp32 ``logits`` row ``rows[i]`` (int64) whose bit
    in ``mask[i]`` (int32 words, llguidance's token bitmask) is clear."""
    if (
        select_backend(logits.device, backend) == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and mask.is_contiguous()
    ):
        return cpu_attention.apply_token_bitmask_cpu(logits, rows, mask)
    return apply_token_bitmask_torch(logits, rows, mask)


def argmax(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``x.argmax(dim=-1)`` of fp32 logits ``[rows, vocab]``, same indices (ties: the first)."""
    if (
        select_backend(x.device, backend) == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] > 0
        and x.shape[1] > 0
        and x.stride(-1) == 1
    ):
        return cpu_attention.argmax_cpu(x)
    return x.argmax(dim=-1)


__all__ = [
    "BACKENDS",
    "allocate_kv_cache",
    "apply_rotary",
    "apply_token_bitmask",
    "argmax",
    "plan_attention",
    "rms_norm",
    "select_backend",
    "silu_and_mul",
    "triton_available",
    "unified_attention",
    "write_kv",
]

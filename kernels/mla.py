"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache.

The cache of one layer is ``latent_cache[num_blocks, block_size, kv_lora_rank + rope_dim]``:
per token the compressed latent ``c`` (``kv_a_proj_with_mqa``'s first ``kv_lora_rank`` outputs
after ``kv_a_layernorm``) followed by the rotated rope key ``k_pe``: 512 + 64 = 576 values at
DeepSeek-V3's sizes, against ``2 * 128 * (128 + 64)`` for per-head K and V.

Attention runs in the latent space (the "absorbed" form). ``kv_b_proj`` maps ``c`` to each
head's ``k_nope = W_UK c`` and ``v = W_UV c``; so ``q_nope . k_nope = (W_UK^T q_nope) . c`` and
``sum_j p_j v_j = W_UV sum_j p_j c_j``. A layer:

    q_latent = absorb_query(q_nope, w_uk)                       # [T, H, kv_lora_rank]
    write_latent(c, k_pe, latent_cache, slot_mapping)
    o = mla_attention(q_latent, q_pe, latent_cache, ...)        # [T, H, kv_lora_rank]
    attn = project_output(o, w_uv)                              # [T, H, v_head_dim]

``mla_attention`` is causal over a flat varlen batch (``query_start_loc``, ``seq_lens``,
``block_table`` as ``kernels.unified_attention``), so the same call serves decodes and prefill
chunks with cached context. ``scale`` is the model's softmax scale (transformers'
``DeepseekV3Attention.scaling``: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` under yarn).
"""

from __future__ import annotations

import torch

from kernels.shape_checks import check_latent_cache


def split_kv_b_proj(
    weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_uk [H, qk_nope_head_dim, L], w_uv [H, v_head_dim, L])`` from ``kv_b_proj.weight``
    ``[H * (qk_nope_head_dim + v_head_dim), L]`` (views, no copy)."""
    per_head = weight.view(num_heads, qk_nope_head_dim + v_head_dim, weight.shape[-1])
    return per_head[:, :qk_nope_head_dim], per_head[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope [T, H, qk_nope_head_dim]`` into the latent space, ``[T, H, L]``."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)


def project_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attention output ``[T, H, L]`` from the latent space to ``[T, H, v_head_dim]``."""
    w = w_uv.to(out_latent.dtype).transpose(1, 2)
    return torch.bmm(out_latent.transpose(0, 1), w).transpose(0, 1)


def allocate_latent_cache(
    num_blocks: int, block_size: int, width: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed paged latent cache of one layer, ``[num_blocks, block_size, width]`` (``width =
    kv_lora_rank + rope_dim``), on huge pages on the CPU where Linux gives them."""
    shape = (num_blocks, block_size, width)
    if torch.device(device).type == "cpu":
        from kernels.huge_pages import zeros_huge

        return zeros_huge(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def write_latent_torch(
    latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """Scatter ``latent [T, L]`` and ``k_pe [T, R]`` into their slots (-1 skipped), in the cache's
    dtype."""
    check_latent_cache(latent, k_pe, latent_cache)
    valid = slot_mapping >= 0
    rows = torch.cat([latent, k_pe], dim=-1)[valid].to(latent_cache.dtype)
    slots = slot_mapping[valid].long()
    block_size = latent_cache.shape[1]
    latent_cache[slots // block_size, slots % block_size] = rows


def mla_attention_torch(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference: per request, gather its latent rows, ``softmax(scale * (q_latent . c + q_pe .
    k_pe))`` under the causal mask, times ``c``. fp32 inside (float64 for float64 inputs)."""
    check_latent_cache(q_latent, q_pe, latent_cache)
    rank = q_latent.shape[-1]
    dtype = torch.promote_types(q_latent.dtype, torch.float32)
    out = torch.empty_like(q_latent) if out is None else out
    block_size = latent_cache.shape[1]
    bounds, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end == start:
            continue
        seq_len, q_len = lens[i], end - start
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        rows = latent_cache[blocks].reshape(-1, latent_cache.shape[2])[:seq_len].to(dtype)
        q = torch.cat([q_latent[start:end], q_pe[start:end]], dim=-1).to(dtype)  # [q_len, H, D]
        scores = torch.einsum("qhd,kd->hqk", q, rows) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        hidden = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,kl->qhl", probs, rows[:, :rank]).to(out.dtype)
    return out


def write_latent(
    latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor, backend: str = "auto",
) -> None:  # fmt: skip
    """Write this step's latents and rope keys into the paged latent cache by slot."""
    from kernels import select_backend

    chosen = select_backend(latent.device, backend)
    if chosen == "triton":
        from kernels.triton_mla import write_latent_triton

        return write_latent_triton(latent, k_pe, latent_cache, slot_mapping)
    if chosen == "cpu" and _cpu_fits(latent, k_pe, latent_cache):
        return write_latent_cpu(latent, k_pe, latent_cache, slot_mapping)
    return write_latent_torch(latent, k_pe, latent_cache, slot_mapping)


def mla_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    scale: float, out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """Causal latent attention of a step's varlen batch (decodes and prefill chunks), output in
    the latent space ``[T, H, kv_lora_rank]`` in ``q_latent``'s dtype."""
    from kernels import select_backend

    args = (q_latent, q_pe, latent_cache, query_start_loc, seq_lens, block_table, scale, out)
    chosen = select_backend(q_latent.device, backend)
    if chosen == "triton":
        from kernels.triton_mla import mla_attention_triton

        return mla_attention_triton(*args)
    if chosen == "cpu" and _cpu_fits(q_latent, q_pe, latent_cache):
        return mla_attention_cpu(*args)
    return mla_attention_torch(*args)


def _cpu_fits(a: torch.Tensor, b: torch.Tensor, cache: torch.Tensor) -> bool:
    ok = (torch.float32, torch.bfloat16)
    return a.dtype == b.dtype and a.dtype in ok and cache.dtype in ok


def write_latent_cpu(
    latent: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """C++ twin of ``write_latent_torch`` (``kernels/csrc/mla_cpu.cpp``)."""
    from kernels import cpu_attention

    check_latent_cache(latent, k_pe, latent_cache)
    cpu_attention._require()
    torch.ops.pagedq.write_latent(latent, k_pe, latent_cache, slot_mapping.long().contiguous())


def mla_attention_cpu(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    scale: float, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """C++ twin of ``mla_attention_torch``, reading the latent rows in place."""
    from kernels import cpu_attention

    check_latent_cache(q_latent, q_pe, latent_cache)
    cpu_attention._require()
    out = torch.empty_like(q_latent) if out is None else out
    torch.ops.pagedq.mla_attention(
        q_latent, q_pe, latent_cache, query_start_loc.long().contiguous(),
        seq_lens.long().contiguous(), block_table.long(), float(scale), out,
    )  # fmt: skip
    return out

"""Torch reference kernels: the CPU path and the oracle for the Triton kernels.

Layout of one layer's cache: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    Slot ``s`` is row ``s % block_size`` of block ``s // block_size``; slots of -1 are skipped.
    """
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    # (block, offset) indexing goes through the strides: any storage order of the cache works.
    index = (slot_mapping // block_size, slot_mapping % block_size)
    kv_cache[0].index_put_(index, key.to(kv_cache.dtype))
    kv_cache[1].index_put_(index, value.to(kv_cache.dtype))


def _gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[num_kv_heads, seq_len, head_dim]`` K and V of one request."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    kv = kv_cache[:, block_ids[:num_blocks]].reshape(2, -1, num_kv_heads, head_dim)[:, :seq_len]
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


def unified_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention over a flat varlen batch of prefill chunks and decodes.

    ``query`` is ``[num_tokens, num_heads, head_dim]``; request ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``, which are the last tokens of its context of
    ``seq_lens[i]`` tokens stored in the blocks ``block_table[i]``. ``plan`` is
    ``build_plan(...)`` of the same metadata, built once per step and shared by every layer;
    without it, the plan is built here. K/V are read in the cache's dtype and upcast to the
    query's (a bf16 cache under an fp32 model).

    The options (``kernels.attention_options``; None leaves plain causal attention, through
    SDPA): ``sliding_window`` W lets query position q see keys q - W < k <= q; ``sinks``
    ``[num_heads]`` adds one logit per head to the softmax denominator (with no value);
    ``logits_soft_cap`` c maps scores to ``c * tanh(scores / c)`` before the mask;
    ``alibi_slopes`` ``[num_heads]`` adds ``slope * (key - query position)`` after it.
    """
    if out is None:
        out = torch.empty_like(query)
    if plan is None:
        plan = build_plan(query_start_loc, seq_lens, block_table, kv_cache.shape[2])
    options = _Options(sliding_window, sinks, logits_soft_cap, alibi_slopes)
    for group in plan.decode_groups:
        _decode_attention(query, kv_cache, group, scale, out, options)
    for start, q_len, seq_len, i in plan.prefills:
        _prefill_attention(
            query, kv_cache, start, q_len, seq_len, block_table[i], scale, out, options
        )
    return out


class _Options:
    """One call's attention options; ``plain`` when none is set (SDPA's path)."""

    __slots__ = ("window", "sinks", "soft_cap", "alibi", "plain")

    def __init__(self, window, sinks, soft_cap, alibi) -> None:
        self.window, self.sinks, self.soft_cap, self.alibi = window, sinks, soft_cap, alibi
        self.plain = window is None and sinks is None and soft_cap is None and alibi is None

    def mask(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """Visible keys: causal, and within the window when there is one (Hugging Face's
        ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``)."""
        visible = key_pos <= query_pos
        if self.window is not None:
            visible = visible & (key_pos > query_pos - self.window)
        return visible


def _attend(q, k, v, mask, scale, options: _Options, relative=None) -> torch.Tensor:
    """``q [B, H, Lq, D]`` over ``k``/``v [B, H_kv, Lk, D]`` under a boolean ``mask``;
    ``relative`` ``[B or 1, 1, Lq, Lk]``: key minus query position (for ALiBi)."""
    if options.sinks is None and options.soft_cap is None and options.alibi is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # Soft-capping, ALiBi and sinks do not fit SDPA: scores, cap, bias, mask, sink column,
    # softmax, in fp32.
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    s = q.float() @ k.transpose(-1, -2) * scale
    if options.soft_cap is not None:
        s = options.soft_cap * torch.tanh(s / options.soft_cap)
    if options.alibi is not None:
        s = s + options.alibi.float().to(s.device).view(1, -1, 1, 1) * relative.float()
    s = s.masked_fill(~mask, float("-inf"))
    if options.sinks is not None:
        sink = options.sinks.float().to(s.device).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return (p @ v).to(q.dtype)


class AttentionPlan:
    """Index tensors derived from one step's batch layout, shared by every layer of the step."""

    __slots__ = ("decode_groups", "prefills")


class _DecodeGroup:
    """Decodes of similar context length, attended together with padding to ``max_len``."""

    __slots__ = ("rows", "blocks", "mask", "max_len", "lens")


# Decodes are sorted by context length and attended in groups of this many, so a short
# context is not padded to the longest one in a large batch.
DECODE_GROUP_SIZE = 32


def build_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> AttentionPlan:
    """The reference's plan of one step: its prefills, and its decodes grouped by length."""
    plan = AttentionPlan()
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    plan.prefills = [(starts[i], q, lens[i], i) for i, q in enumerate(query_lens) if q > 1]
    decodes = sorted((i for i, q in enumerate(query_lens) if q == 1), key=lambda i: lens[i])
    plan.decode_groups = [
        _decode_group(decodes[g : g + DECODE_GROUP_SIZE], starts, lens, block_table, block_size)
        for g in range(0, len(decodes), DECODE_GROUP_SIZE)
    ]
    return plan


def _decode_group(members, starts, lens, block_table, block_size) -> _DecodeGroup:
    device = block_table.device
    group = _DecodeGroup()
    group.rows = torch.tensor([starts[i] for i in members], device=device)
    group.max_len = max(lens[i] for i in members)
    num_blocks = -(-group.max_len // block_size)
    idx = torch.tensor(members, device=device)
    group.blocks = block_table[idx, :num_blocks].clamp_min(0)
    group.lens = torch.tensor([lens[i] for i in members], device=device)
    mask = torch.arange(group.max_len, device=device)[None, :] < group.lens[:, None]
    group.mask = mask[:, None, None, :]
    return group


def _prefill_attention(
    query, kv_cache, start, q_len, seq_len, block_ids, scale, out, options: _Options
) -> None:
    k, v = _gather_kv(kv_cache, block_ids, seq_len)
    k, v = k.to(query.dtype), v.to(query.dtype)
    q = query[start : start + q_len].transpose(0, 1)
    num_context = seq_len - q_len
    # Query row j sits at absolute position num_context + j and sees keys 0..num_context + j.
    key_pos = torch.arange(seq_len, device=query.device)
    query_pos = torch.arange(num_context, seq_len, device=query.device)
    if options.plain:
        mask = key_pos[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
    else:
        # Keys before the first row's window are seen by no row: leave them out.
        first = max(0, num_context - options.window + 1) if options.window is not None else 0
        k, v, key_pos = k[:, first:], v[:, first:], key_pos[first:]
        mask = options.mask(key_pos[None, :], query_pos[:, None])
        relative = None
        if options.alibi is not None:
            relative = (key_pos[None, :] - query_pos[:, None])[None, None]
        o = _attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale, options, relative)
    out[start : start + q_len] = o[0].transpose(0, 1)


def _decode_attention(query, kv_cache, group: _DecodeGroup, scale, out, options) -> None:
    """A group of single-token queries at once: one gather, one padded masked attention."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    batch = group.rows.shape[0]
    kv = kv_cache[:, group.blocks].reshape(2, batch, -1, num_kv_heads, head_dim)
    kv = kv[:, :, : group.max_len].to(query.dtype)
    q = query[group.rows].unsqueeze(2)  # [batch, num_heads, 1, head_dim]
    mask = group.mask
    relative = None
    if options.window is not None or options.alibi is not None:
        key_pos = torch.arange(group.max_len, device=query.device)[None, :]
        if options.window is not None:  # each decode sits at position lens - 1
            mask = mask & (key_pos > group.lens[:, None] - 1 - options.window)[:, None, None, :]
        if options.alibi is not None:
            relative = (key_pos - (group.lens[:, None] - 1))[:, None, None, :]
    o = _attend(q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), mask, scale, options, relative)
    out[group.rows] = o.squeeze(2)


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x + residual) * weight, x + residual)``; without a residual, ``(norm(x), None)``.

    The sum is rounded to the residual stream's dtype (x's, or fp32: a bf16 model's stream kept
    in fp32); the norm and its scale run in fp32 and are rounded once to x's dtype. ``weight`` is
    fp32 or x's dtype. (Hugging Face's Llama rounds the normed values before the scale: a second
    rounding in bf16 that fp32 does not make.)"""
    dtype = x.dtype
    if residual is not None:
        x = (x.to(residual.dtype) + residual).to(residual.dtype)
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(dtype), residual


def apply_token_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Set ``logits[rows[i], j]`` to -inf, in place, where bit ``j % 32`` of ``mask[i, j // 32]``
    (int32 words, a grammar's token bitmask) is clear; columns past the mask are forbidden."""
    vocab = logits.shape[1]
    words = min(mask.shape[1], -(-vocab // 32))
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask[:, :words, None] >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]
    if allowed.shape[1] < vocab:
        pad = torch.zeros(len(rows), vocab - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(allowed.device)], dim=1)
    allowed = allowed.to(logits.device, non_blocking=True)
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` ``[T, 2d]``: SwiGLU as Hugging Face computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_apply_torch(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by a step's ``cos`` and ``signed_sin`` ``[T, 1, D]``.

    ``signed_sin`` carries rotate-half's minus sign: ``cat(-x2, x1) * sin`` equals
    ``roll(x, D/2) * signed_sin`` exactly (negation is exact), so this is bit for bit
    ``rotary_torch``'s (and Hugging Face's) result.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rotary_torch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, heads, D]`` and ``key`` ``[T, kv_heads, D]`` by ``positions``.

    ``cos_cache``/``sin_cache`` are ``[max_position, D]`` with both halves equal, as in HF.
    """
    cos = cos_cache[positions].to(query.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(query.dtype).unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


# --- mixture of experts -----------------------------------------------------------------------
def moe_activation_torch(
    gate_up: torch.Tensor, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """An expert's activation of its ``[rows, 2I]`` gate_up output (gate half first):
    ``silu(gate) * up``, or gpt-oss's clamped SwiGLU (``"swigluoai"``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation != "swigluoai":
        raise ValueError(f"activation={activation!r} is not supported: 'silu' or 'swigluoai'")
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def grouped_mm_torch(
    rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``rows`` ``[N, K]`` (grouped by expert, ``counts[e]`` rows each) times ``weight[e]``
    ``[K, out]`` per group, as one grouped op: ``torch._grouped_mm`` where this torch has it
    (and the sizes give it 16-byte strides), else one bmm over the groups padded to the
    largest."""
    size = rows.element_size()
    if (
        hasattr(torch, "_grouped_mm")
        and rows.dtype in (torch.float32, torch.bfloat16)
        and all(n * size % 16 == 0 for n in weight.shape[1:])  # its rows' 16-byte strides
    ):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(rows, weight.to(rows.dtype), offs=offs)
    experts = weight.shape[0]
    starts = counts.cumsum(0) - counts
    owner = torch.repeat_interleave(torch.arange(experts, device=rows.device), counts)
    pos = torch.arange(rows.shape[0], device=rows.device) - starts[owner]
    padded = rows.new_zeros(experts, int(counts.max()) if rows.shape[0] else 0, rows.shape[1])
    padded[owner, pos] = rows
    return torch.bmm(padded, weight.to(rows.dtype))[owner, pos]


def fused_experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` with ``w13`` ``[E, 2I, H]``
    (gate rows, then up rows) and ``w2`` ``[E, H, I]``: the (token, slot) pairs sorted by
    expert, then two grouped GEMMs (no loop over experts); the weighted sum in fp32, returned
    as ``out_dtype`` (x's dtype, or fp32)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.bincount(flat, minlength=w13.shape[0])
    token = order // top_k
    gate_up = grouped_mm_torch(x[token], w13.transpose(1, 2), counts)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[expert].to(gate_up.dtype)
    hidden = moe_activation_torch(gate_up, activation, alpha, limit)
    y = grouped_mm_torch(hidden, w2.transpose(1, 2), counts)
    if w2_bias is not None:
        y = y + w2_bias[expert].to(y.dtype)
    y = y.float() * topk_weights.reshape(-1)[order, None].float()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, y).to(out_dtype or x.dtype)

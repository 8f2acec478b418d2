"""The shared self-attention layer: merged QKV, GQA, rotary, the paged KV cache, and the options
today's families add (biases, QK-norm, partial rotary, sliding windows, sinks, soft-capping, an
output gate)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionMetadata, PagedAttention
from engine.models.norm import RMSNorm, ShardedRMSNorm
from engine.models.rotary import deinterleave
from engine.parallel.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.parallel.state import tp_rank, tp_size
from kernels import apply_rotary

QK_NORMS = (None, "head", "proj")


@dataclass(slots=True)
class AttentionOptions:
    """What a family sets on its attention layers; every default changes nothing."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": per head (Qwen3, Gemma 3); "proj": whole (OLMo 2)
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # QK-norm scales by 1 + w (Gemma)
    rotary_dim: int | None = None  # partial rotary: the leading features that rotate
    scale: float | None = None  # softmax scale; default head_dim ** -0.5
    sliding_window: int | None = None  # attend to the last W positions only
    sinks: bool = False  # a learned per-head logit in the softmax (gpt-oss)
    logits_soft_cap: float | None = None  # cap * tanh(scores / cap) (Gemma 2)
    # Qwen3.5 / Qwen3-Next: q_proj also gives a gate per head (``[q_h, gate_h]`` per head) and
    # the attention output is scaled by sigmoid(gate) before o_proj.
    output_gate: bool = False
    # LFM3: g_proj gives one gate per head from the layer's input; each head's output is scaled
    # by sigmoid(gate) before o_proj.
    head_gate: bool = False
    qk_norm_scale: bool = True  # False: a QK-norm with no learned scale (Llama 4's L2 norm)
    # Llama 4: features rotate in adjacent pairs (x0, x1), (x2, x3)... (complex rotary), not in
    # halves: q and k are laid out [evens | odds] first (attention is the same for any layout
    # q and k share).
    rope_interleave: bool = False
    attention_chunk_size: int | None = None  # Llama 4: keys of the query's own chunk only
    # MiMo-V2-Flash: values narrower than keys (cached padded to the key width: one paged cache
    # of K and V) and scaled by ``value_scale`` as they are projected.
    v_head_dim: int | None = None
    value_scale: float | None = None
    # BLOOM, MPT: ALiBi, one slope per query head of the whole model (``alibi.py``); each
    # head's scores gain ``slope * (key - query position)``. No rotary goes with it.
    alibi_slopes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(
                f"qk_norm={self.qk_norm!r} is not supported: must be one of {QK_NORMS}"
            )


class Attention(nn.Module):
    """Self-attention over one flat varlen batch with the paged KV cache."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: str,
        options: AttentionOptions | None = None,
    ) -> None:
        super().__init__()
        opts = options or AttentionOptions()
        self.output_gate = opts.output_gate
        q_head_dim = head_dim * (2 if opts.output_gate else 1)
        self.v_head_dim = opts.v_head_dim or head_dim
        if self.v_head_dim > head_dim:
            raise ValueError(
                f"v_head_dim={self.v_head_dim} is not supported: must be <= head_dim={head_dim}"
            )
        self.value_scale = opts.value_scale
        self.qkv_proj = QKVParallelLinear(
            hidden_size, num_heads, num_kv_heads, head_dim, opts.qkv_bias, q_head_dim,
            self.v_head_dim,
        )  # fmt: skip
        # This rank's heads (all of them at one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, hidden_size, bias=opts.o_bias)
        # This rank's heads' gates.
        self.g_proj = ColumnParallelLinear(hidden_size, num_heads) if opts.head_gate else None
        self.qk_norm = opts.qk_norm
        if opts.qk_norm == "proj" and tp_size() > 1:
            # Over every head's features: each rank's part, the mean square summed over ranks.
            self.q_norm = ShardedRMSNorm(
                self.q_size, num_heads * head_dim, tp_rank() * self.q_size, opts.norm_eps
            )
            copies = max(1, tp_size() // num_kv_heads)
            self.k_norm = ShardedRMSNorm(
                self.kv_size, num_kv_heads * head_dim, self.qkv_proj.kv_head0 * head_dim,
                opts.norm_eps, copies,
            )  # fmt: skip
        elif opts.qk_norm is not None:
            q_dim, k_dim = (
                (head_dim, head_dim) if opts.qk_norm == "head" else (self.q_size, self.kv_size)
            )
            self.q_norm = RMSNorm(
                q_dim, opts.norm_eps, backend, opts.norm_unit_offset, opts.qk_norm_scale
            )
            self.k_norm = RMSNorm(
                k_dim, opts.norm_eps, backend, opts.norm_unit_offset, opts.qk_norm_scale
            )
        self.rotary_dim = opts.rotary_dim or head_dim
        self.sliding_window = opts.sliding_window
        self.attention_chunk_size = opts.attention_chunk_size
        self.rope_interleave = opts.rope_interleave
        self.backend = backend
        if opts.sinks:  # this rank's heads' sinks
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
            self.sinks.weight_loader = self._load_sinks
            self.sinks.checkpoint_shape = lambda shard: (num_heads,)
        extra = {}
        if opts.sliding_window is not None:
            extra["sliding_window"] = opts.sliding_window
        if opts.sinks:
            extra["sinks"] = self.sinks
        if opts.logits_soft_cap is not None:
            extra["logits_soft_cap"] = opts.logits_soft_cap
        if opts.attention_chunk_size is not None:
            extra["attention_chunk_size"] = opts.attention_chunk_size
        if opts.alibi_slopes is not None:  # this rank's heads', fp32 whatever the model's dtype
            slopes = torch.tensor(opts.alibi_slopes, dtype=torch.float32)
            extra["alibi_slopes"] = slopes[tp_rank() * self.num_heads :][: self.num_heads]
        scale = opts.scale if opts.scale is not None else head_dim**-0.5
        self.attn = PagedAttention(scale, backend, **extra)

    def _load_sinks(self, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        param.data.copy_(tensor.narrow(0, tp_rank() * self.num_heads, self.num_heads))

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[q | k | v]`` of ``hidden`` (Zamba2 adds a low-rank adapter of its own)."""
        return self.qkv_proj(hidden)

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """``rope`` is the step's ``(cos, signed_sin)`` from ``RotaryEmbedding.cos_sin``, or None
        for a layer without positions (NoPE: Granite 4.0-H, Nemotron-H); a third element
        ``query_scale`` ``[tokens]`` fp32 scales each token's query after rotation (cos and sin
        None: a NoPE layer's, Llama 4's attention temperature)."""
        num_tokens, heads = hidden.shape[0], self.num_heads
        qkv = self.project_qkv(hidden)
        gate = None
        if self.output_gate:
            q_gate = qkv[:, : 2 * self.q_size].view(num_tokens, heads, 2, self.head_dim)
            gate = q_gate[:, :, 1].reshape(num_tokens, self.q_size)
            q = q_gate[:, :, 0].reshape(num_tokens, self.q_size)
            qkv = torch.cat((q, qkv[:, 2 * self.q_size :]), dim=1)
        qk_size = self.q_size + self.kv_size
        if self.qk_norm == "proj":
            qkv = torch.cat(
                (
                    self.q_norm(qkv[:, : self.q_size]),
                    self.k_norm(qkv[:, self.q_size : qk_size]),
                    qkv[:, qk_size:],
                ),
                dim=1,
            )
        # q and k sit side by side in qkv: one rotation for both, on a view (no split copies).
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm == "head":
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        cos, sin, *query_scale = rope if rope is not None else (None, None)
        if cos is not None and self.rope_interleave:
            qk = deinterleave(qk)
        # In place on qkv where the backend can (the C++ kernel on the CPU).
        if cos is not None and self.rotary_dim == self.head_dim:
            qk = apply_rotary(qk, cos, sin, backend=self.backend)
        elif cos is not None:
            part = qk[..., : self.rotary_dim]
            part.copy_(apply_rotary(part, cos, sin, backend=self.backend))
        q = qk[:, :heads]
        if query_scale:  # in fp32, rounded once, as transformers scales it
            q = (q * query_scale[0][:, None, None]).to(q.dtype)
        v = qkv[:, qk_size:].view(num_tokens, -1, self.v_head_dim)
        if self.value_scale is not None:
            v = v * self.value_scale
        if self.v_head_dim != self.head_dim:  # zeros to the key width, dropped from the output
            v = torch.nn.functional.pad(v, (0, self.head_dim - self.v_head_dim))
        slopes = self.attn.alibi_slopes
        if slopes is not None and slopes.device != q.device:  # kept off the model's .to()
            self.attn.alibi_slopes = slopes.to(q.device)
        out = self.attn(q, qk[:, heads:], v, kv_cache, meta)
        if self.v_head_dim != self.head_dim:
            out = out.view(num_tokens, heads, self.head_dim)[..., : self.v_head_dim]
        if self.g_proj is not None:
            head_gate = torch.sigmoid(self.g_proj(hidden)).unsqueeze(-1)
            out = out.view(num_tokens, heads, self.head_dim) * head_gate
        out = out.reshape(num_tokens, heads * self.v_head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

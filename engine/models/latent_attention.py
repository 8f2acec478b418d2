"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the paged latent cache.

Per token the layer caches one row, ``[c | k_pe]``: the latent ``c`` (``kv_a_proj_with_mqa``'s
first ``kv_lora_rank`` outputs after ``kv_a_layernorm``) and the rotated rope key ``k_pe``
shared by every head. Attention runs absorbed, in the latent space, for prefill chunks and
decodes alike (``kernels/mla.py``): each head's ``q_nope`` is taken through ``W_UK`` (the key
half of ``kv_b_proj``) into the latent space, and the output back through ``W_UV``.

Over N tensor-parallel ranks the heads split: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are
column-parallel by heads, so each rank's ``W_UK`` / ``W_UV`` are its own heads', and ``o_proj``
is row-parallel (the one all-reduce). The latent down-projections and the cache are replicated:
every head reads the same latent row, so each rank writes and reads the whole of it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.kv_cache_spec import LatentAttentionSpec
from engine.models.linear import MergedLinear
from engine.models.norm import RMSNorm
from engine.models.rotary import deinterleave, rope_parameters
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.parallel.state import divide, tp_size
from kernels import apply_rotary, select_backend
from kernels.mla import absorb_query, mla_attention, project_output, split_kv_b_proj, write_latent

# transformers' DeepseekV3RMSNorm of q_a and kv_a keeps its default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` under a scaled RoPE with
    ``mscale_all_dim`` (yarn), as transformers' ``DeepseekV3Attention.scaling``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    factor = params.get("factor", 1.0)
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """Queries through a LoRA (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; merged with
    ``kv_a_proj_with_mqa`` into one GEMM as ``qkv_a_proj``) or a plain ``q_proj``; RoPE on the
    ``qk_rope_head_dim`` part only, in DeepSeek's interleaved pairs where ``rope_interleave``
    (the config's, True where it has none, as DeepSeek-V2's complex rotary pairs them; MiniCPM3
    passes False)."""

    def __init__(self, config, backend: str = "auto", rope_interleave: bool | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        all_heads = config.num_attention_heads
        # This rank's heads (all of them at one rank).
        self.num_heads = divide(all_heads, tp_size(), "num_attention_heads")
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_head_dim = config.qk_nope_head_dim, config.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        kv_a = self.kv_lora_rank + self.rope_dim
        if self.q_lora_rank is not None:
            self.qkv_a_proj = MergedLinear(hidden, {"q_a": self.q_lora_rank, "kv_a": kv_a}, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, backend)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, all_heads * self.qk_head_dim)
        else:
            self.q_proj = ColumnParallelLinear(hidden, all_heads * self.qk_head_dim)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_a, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, backend)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, all_heads * (self.nope_dim + self.v_head_dim)
        )
        # Never run as a linear: its weight is read as W_UK and W_UV (views, per head).
        self.kv_b_proj.no_prepack = True
        self.o_proj = RowParallelLinear(all_heads * self.v_head_dim, hidden, bias=bias)
        if rope_interleave is None:
            rope_interleave = bool(getattr(config, "rope_interleave", True))
        self.rope_interleave = rope_interleave
        self.scale = softmax_scale(config)
        # LongCat-Flash's LoRA scales: the query and the normed latent multiplied as projected.
        self.q_scale: float | None = None
        self.latent_scale: float | None = None
        self.backend = backend
        self._resolved: dict[torch.device, str] = {}

    def kv_cache_spec(self) -> LatentAttentionSpec:
        """One latent row per token, whole on every rank (its size is the same at any N)."""
        return LatentAttentionSpec(self.kv_lora_rank, self.rope_dim)

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """``rope`` is the step's ``(cos, signed_sin)`` of width ``qk_rope_head_dim``, or None
        for a model without positions (Kimi Linear: the rope part is used as it is), or
        ``(cos, signed_sin, query_scale)`` where each token's query is scaled after rotation
        (``query_scale`` ``[tokens]``: Mistral 4's Llama-4 attention scaling);
        ``kv_cache`` the layer's ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``."""
        num_tokens, heads, rank = hidden.shape[0], self.num_heads, self.kv_lora_rank
        q_resid = gate = None
        if self.q_lora_rank is not None:
            q_a, kv_a = self.qkv_a_proj(hidden).split([self.q_lora_rank, rank + self.rope_dim], 1)
            q, q_resid, gate = self.project_query(q_a)
        else:
            q, kv_a = self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        if self.q_scale is not None:
            q = q * self.q_scale
        q_nope, q_pe = q.view(num_tokens, heads, self.qk_head_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        latent = self.kv_a_layernorm(kv_a[:, :rank])
        if self.latent_scale is not None:
            latent = latent * self.latent_scale
        # Every head's rope query and the shared rope key: one rotation for all of them.
        pe = torch.cat((q_pe, kv_a[:, None, rank:]), dim=1)
        query_scale = None
        if rope is not None:
            cos, sin, *rest = rope
            if self.rope_interleave:
                pe = deinterleave(pe)
            pe = apply_rotary(pe, cos, sin, backend=self.backend)
            if rest:
                query_scale = rest[0][:, None, None]
        backend = self._backend(hidden.device)
        latent_cache = kv_cache[..., : rank + self.rope_dim]
        write_latent(latent, pe[:, heads], latent_cache, meta.slot_mapping, backend=backend)
        w_uk, w_uv = split_kv_b_proj(self.kv_b_proj.weight, heads, self.nope_dim, self.v_head_dim)
        q_pe = pe[:, :heads]
        if query_scale is not None:
            q_nope, q_pe = q_nope * query_scale, q_pe * query_scale
        q_latent = absorb_query(q_nope, w_uk)
        extra = (rope, hidden, q_resid)
        out = self.attend(q_latent, q_pe, kv_cache, meta, backend, *extra)
        out = project_output(out, w_uv).reshape(num_tokens, -1)
        return self.o_proj(self.gate_output(out, gate, hidden))

    def gate_output(self, out: torch.Tensor, gate, hidden: torch.Tensor) -> torch.Tensor:
        """The heads' output ``[tokens, heads * v_head_dim]`` before ``o_proj``, scaled by
        ``sigmoid(gate)`` where ``project_query`` gave one (in fp32, rounded once, as
        transformers gates it); Ling's gate per head overrides this."""
        if gate is None:
            return out
        return (out * torch.sigmoid(gate.float())).to(out.dtype)

    def project_query(self, q_a: torch.Tensor):
        """``(q, q_resid, output gate or None)`` from the query LoRA's down projection ``q_a``:
        ``q_b_proj`` of the normed latent (A.X-K2 derives a gate per head too)."""
        q_resid = self.q_a_layernorm(q_a)
        return self.q_b_proj(q_resid), q_resid, None

    def attend(self, q_latent, q_pe, kv_cache, meta, backend, rope, hidden, q_resid):
        """Absorbed attention over the latent cache (DeepSeek Sparse Attention chooses the keys
        first: ``sparse_attention.py``, from the step's ``rope``, ``hidden`` and ``q_resid``)."""
        return mla_attention(
            q_latent, q_pe, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
            self.scale, backend=backend,
        )  # fmt: skip

    def _backend(self, device: torch.device) -> str:
        chosen = self._resolved.get(device)
        if chosen is None:
            chosen = self._resolved[device] = select_backend(device, self.backend)
        return chosen

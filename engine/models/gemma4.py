"""Gemma 4 (text): Gemma 3's sandwich block with plain RMSNorms (``w``, not ``1 + w``), and:

- per-layer head sizes: full-attention layers use ``global_head_dim`` (and
  ``num_global_key_value_heads``), their RoPE "proportional" (a partial rotation);
- QK-norm and a scale-free V-norm, softmax scale 1;
- K = V on full layers (``attention_k_eq_v``: no ``v_proj``; V is the raw K projection);
- KV shared across layers: the last ``num_kv_shared_layers`` layers write no K/V and attend
  over the cache of the last earlier layer of their type (``kv_shared_from``);
- per-layer input embeddings: a second embedding table plus a projection of the embeddings
  gives each layer a small input, gated into its output; a learned ``layer_scalar``;
- final logit soft-capping.

- a mixture of experts beside the dense MLP (``enable_moe_block``, 26B-A4B): its router reads
  the block's input (a scale-free RMSNorm, a learned scale, softmax, top k renormalised, a
  per-expert scale), its GeGLU experts run as grouped GEMMs over the routed tokens (the torch
  reference's ``grouped_mm_torch``: no loop over experts), and its output joins the MLP's
  between their own norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import PagedAttention
from engine.models.causal_lm import CausalLM
from engine.models.config_fields import layer_sliding_window
from engine.models.decoder import DecoderLayer
from engine.models.linear import MergedLinear, linear_fp32_out
from engine.models.mlp import GatedMLP
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding
from kernels import apply_rotary
from kernels.reference import grouped_mm_torch


class Gemma4Attention(nn.Module):
    """Gemma 4's attention of one layer (see the module docstring)."""

    def __init__(self, config, layer_idx: int, max_position: int, backend: str) -> None:
        super().__init__()
        layer = config.per_layer_config[layer_idx]
        self.num_heads, self.num_kv_heads = config.num_attention_heads, layer.num_key_value_heads
        self.head_dim = head_dim = layer.head_dim
        self.shares_kv = config.kv_sharing_modes[layer_idx] == "reuse"
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and not sliding
        self.q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        shards = {"q": self.q_size}
        if not self.shares_kv:
            shards["k"] = kv_size
            if not self.k_eq_v:
                shards["v"] = kv_size
        eps, bias = config.rms_norm_eps, bool(config.attention_bias)
        self.qkv_proj = MergedLinear(config.hidden_size, shards, bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, backend)
        if not self.shares_kv:
            self.k_norm = RMSNorm(head_dim, eps, backend)
            self.v_norm = RMSNorm(head_dim, eps, backend, with_scale=False)
        self.backend = backend
        self.sliding_window = layer_sliding_window(config, layer_idx, max_position)
        self.attn = PagedAttention(1.0, backend, sliding_window=self.sliding_window)

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, -1, self.head_dim))
        q = apply_rotary(q, *rope, backend=self.backend)
        if self.shares_kv:
            out = self.attn(q, None, None, kv_cache, meta)
        else:
            kv = qkv[:, self.q_size :].view(num_tokens, -1, self.head_dim)
            k = kv[:, : self.num_kv_heads]
            v = self.v_norm(k if self.k_eq_v else kv[:, self.num_kv_heads :])
            k = apply_rotary(self.k_norm(k), *rope, backend=self.backend)
            out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Gemma4Router(nn.Module):
    """``(topk_weights fp32, topk_ids)`` ``[tokens, top_k]`` of Gemma 4's router."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        self.top_k = config.top_k_experts
        self.norm = RMSNorm(hidden, config.rms_norm_eps, backend, with_scale=False)
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.proj.no_prepack = True  # a few columns: the plain GEMM is as fast
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))

    def forward(self, x: torch.Tensor):
        scores = linear_fp32_out(self.norm(x) * self.scale * x.shape[-1] ** -0.5, self.proj.weight)
        weights, ids = torch.topk(torch.softmax(scores, dim=-1, dtype=torch.float32), self.top_k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """GeGLU experts ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up) and ``down_proj``
    ``[E, H, I]``, as transformers stores them."""

    def __init__(self, config) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        inter = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0])
        token = order // top_k
        gate, up = grouped_mm_torch(x[token], self.gate_up_proj.transpose(1, 2), counts).chunk(
            2, dim=-1
        )
        y = grouped_mm_torch(F.gelu(gate, approximate="tanh") * up, self.down_proj.mT, counts)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


class Gemma4DecoderLayer(DecoderLayer):
    """The sandwich block, then the layer's per-layer input gated in, then ``layer_scalar``."""

    def __init__(self, config, layer_idx: int, max_position: int, backend: str) -> None:
        wide = config.use_double_wide_mlp and config.kv_sharing_modes[layer_idx] == "reuse"
        mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size * (2 if wide else 1),
            backend,
            activation=config.hidden_activation,
        )
        attn = Gemma4Attention(config, layer_idx, max_position, backend)
        super().__init__(attn, mlp, config.hidden_size, config.rms_norm_eps, backend, "sandwich")
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.has_moe = bool(getattr(config, "enable_moe_block", False))
        if self.has_moe:
            eps, size = config.rms_norm_eps, config.hidden_size
            self.router = Gemma4Router(config, backend)
            self.experts = Gemma4Experts(config)
            self.pre_feedforward_layernorm_2 = RMSNorm(size, eps, backend)
            self.post_feedforward_layernorm_1 = RMSNorm(size, eps, backend)
            self.post_feedforward_layernorm_2 = RMSNorm(size, eps, backend)
        self.per_layer_size = getattr(config, "hidden_size_per_layer_input", None)
        if self.per_layer_size:
            size = self.per_layer_size
            self.per_layer_input_gate = nn.Linear(config.hidden_size, size, bias=False)
            self.per_layer_projection = nn.Linear(size, config.hidden_size, bias=False)
            self.post_per_layer_input_norm = RMSNorm(
                config.hidden_size, config.rms_norm_eps, backend
            )

    def forward_with_input(self, rope, hidden, per_layer_input, kv_cache, meta):
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.has_moe:  # the experts read the block's input, beside the dense MLP
            routed = self.experts(self.pre_feedforward_layernorm_2(hidden), *self.router(hidden))
            mlp = self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(routed)
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if self.per_layer_size:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh")
            extra = self.per_layer_projection(gate * per_layer_input)
            hidden = hidden + self.post_per_layer_input_norm(extra)
        return hidden * self.layer_scalar


def share_kv(layer: nn.Module, config, i: int) -> None:
    """Where layer ``i`` reads another's KV (``kv_sharing_modes[i]`` "reuse"), set its
    ``kv_shared_from``: the last earlier layer of its type that keeps a cache."""
    modes, types = config.kv_sharing_modes, config.layer_types
    if modes[i] == "reuse":
        layer.kv_shared_from = max(
            j for j in range(i) if modes[j] != "reuse" and types[j] == types[i]
        )


def is_unused_kv_weight(layers: nn.ModuleList, name: str) -> bool:
    """True for a K/V weight of a layer that reads another's KV: checkpoints keep some, and
    they never run."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "layers" and parts[2] == "self_attn":
        shares = layers[int(parts[1])].self_attn.shares_kv
        return shares and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm")
    return False


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4 (text)."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError(
                "use_bidirectional_attention='all' (an embedding model) is not supported: "
                "pagedq runs causal language models"
            )
        super().__init__(config, max_position, backend)
        self.embed_scale = config.hidden_size**0.5
        self.final_logit_softcapping = config.final_logit_softcapping
        for layer_type in sorted(set(config.layer_types)):
            head_dim = config.per_layer_config[layer_type].head_dim
            self.rotaries[layer_type] = RotaryEmbedding(
                config, head_dim, max_position, layer_type=layer_type
            )
        for i in range(config.num_hidden_layers):
            layer = Gemma4DecoderLayer(config, i, max_position, backend)
            layer.rope_key = config.layer_types[i]
            share_kv(layer, config, i)
            self.layers.append(layer)
        self.norm = self.make_norm()
        self.per_layer_size = size = getattr(config, "hidden_size_per_layer_input", None)
        if size:
            layers = config.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(
                config.vocab_size_per_layer_input, layers * size
            )
            self.per_layer_model_projection = nn.Linear(
                config.hidden_size, layers * size, bias=False
            )
            self.per_layer_projection_norm = RMSNorm(size, config.rms_norm_eps, backend)

    def per_layer_inputs(self, input_ids, embeds) -> torch.Tensor:
        """``[num_tokens, num_layers, size]``: each layer's input, from the token's row of the
        per-layer table and a projection of its (scaled) embedding."""
        num_tokens, size = input_ids.shape[0], self.per_layer_size
        table = self.embed_tokens_per_layer(input_ids)
        table = table * torch.tensor(size**0.5, dtype=table.dtype)
        projected = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(num_tokens, -1, size))
        return (projected + table.view(num_tokens, -1, size)) * 2.0**-0.5

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        ropes = {key: r.cos_sin(positions, hidden.dtype) for key, r in self.rotaries.items()}
        for i, layer in enumerate(self.layers):
            layer_input = per_layer[:, i] if per_layer is not None else None
            hidden = layer.forward_with_input(
                ropes[layer.rope_key], hidden, layer_input, kv_caches[i], meta[i]
            )
        return self.norm(hidden)

    def checkpoint_name(self, name: str) -> str | None:
        return None if is_unused_kv_weight(self.layers, name) else super().checkpoint_name(name)

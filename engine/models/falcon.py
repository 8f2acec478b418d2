"""Falcon (``falcon``: Falcon-7B / 40B / 180B, Falcon 2 11B, Falcon-RW): LayerNorms with
biases, one fused ``query_key_value`` projection in one of three layouts (multi-query: all q
heads, then one k and one v; the new decoder architecture: per KV group its q heads, its k and
its v; else per head q, k, v), a GeLU MLP, and attention and MLP side by side on the block's
input (``parallel_attn``; the new architecture with a LayerNorm each, ``num_ln_in_parallel_attn``
2) or one after the other. Positions by RoPE, or by ALiBi where ``alibi`` (Falcon-RW: BLOOM's
slopes as transformers applies them, rounded to bf16 and divided by ``sqrt(head_dim)``).
Transformers' Falcon calls no ``AttentionInterface``, so the backend cannot run it: this file
does."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from engine.models.alibi import bloom_slopes
from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.mlp import GeluMLP
from engine.models.rotary import RotaryEmbedding

# Checkpoint module names -> ours (after ``transformer.`` is dropped).
_RENAMES = (
    ("word_embeddings.", "embed_tokens."),
    ("h.", "layers."),
    ("ln_f.", "norm."),
    (".self_attention.dense.", ".self_attn.o_proj."),
)


def falcon_alibi(config) -> tuple[float, ...] | None:
    """Falcon-RW's ALiBi slopes as the attention adds them, or None (RoPE)."""
    if not config.alibi:
        return None
    heads = config.num_attention_heads
    slopes = torch.tensor(bloom_slopes(heads)).bfloat16().float()
    return tuple((slopes / math.sqrt(config.hidden_size // heads)).tolist())


class FalconDecoderLayer(nn.Module):
    """Attention and MLP in parallel on the input, or in sequence; residuals added here."""

    def __init__(self, config, num_kv_heads: int, backend: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        eps, bias = config.layer_norm_epsilon, bool(config.bias)
        self.self_attn = Attention(
            hidden, heads, num_kv_heads, hidden // heads, backend,
            AttentionOptions(qkv_bias=bias, o_bias=bias, alibi_slopes=falcon_alibi(config)),
        )  # fmt: skip
        self.mlp = GeluMLP(hidden, config.ffn_hidden_size or 4 * hidden, bias)
        self.parallel = bool(config.parallel_attn or config.new_decoder_architecture)
        self.two_norms = bool(config.new_decoder_architecture) and (
            config.num_ln_in_parallel_attn in (None, 2)
        )
        if self.two_norms:
            self.ln_attn = nn.LayerNorm(hidden, eps=eps)
            self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
            if not self.parallel:
                self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """``(x + attn + mlp, None)``: the residual is added inside the block."""
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        attn = self.self_attn(rope, attn_in, kv_cache, meta)
        if not self.parallel:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden)), None
        return hidden + (self.mlp(mlp_in) + attn), None


class FalconForCausalLM(CausalLM):
    """Falcon, with rotary or ALiBi positions."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        heads = config.num_attention_heads
        if config.new_decoder_architecture:
            self.num_kv_heads = config.num_kv_heads
        else:
            self.num_kv_heads = 1 if config.multi_query else heads
        head_dim = config.hidden_size // heads
        if not config.alibi:
            self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        for _ in range(config.num_hidden_layers):
            layer = FalconDecoderLayer(config, self.num_kv_heads, backend)
            layer.rope_key = None if config.alibi else "default"
            self.layers.append(layer)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("transformer.")
        return super().checkpoint_name(renamed(name, _RENAMES))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The fused ``query_key_value`` tensors split into q, k and v in our order."""
        super().load_weights(self._split_qkv(weights))

    def _split_qkv(self, weights):
        config, heads = self.config, self.config.num_attention_heads
        head_dim, kv = config.hidden_size // heads, self.num_kv_heads
        for name, tensor in weights:
            if ".self_attention.query_key_value." not in name:
                yield name, tensor
                continue
            rest = tensor.shape[1:]
            if config.new_decoder_architecture:  # per KV group: its q heads, its k, its v
                grouped = tensor.view(kv, heads // kv + 2, head_dim, *rest)
                q, k, v = grouped[:, :-2], grouped[:, -2], grouped[:, -1]
            elif config.multi_query:  # every q head, then one k and one v
                q, k, v = tensor.view(heads + 2, head_dim, *rest).split([heads, 1, 1])
            else:  # per head: q, k, v
                per_head = tensor.view(heads, 3, head_dim, *rest)
                q, k, v = per_head[:, 0], per_head[:, 1], per_head[:, 2]
            prefix = name.replace(".self_attention.query_key_value.", ".self_attn.{}.")
            for part, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                yield prefix.format(part), t.reshape(-1, *rest).contiguous()

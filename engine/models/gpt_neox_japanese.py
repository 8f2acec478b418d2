"""GPT-NeoX-Japanese (``gpt_neox_japanese``, ABEJA 2.7B): LayerNorm-first blocks, q/k/v fused
per head in ``query_key_value`` (split at load), partial rotary (``partial_rotary_factor``, in
halves), bias-free projections save a ``dense_bias`` after the last layer's attention output,
a GeLU MLP of ``intermediate_multiple_size`` x the hidden size, the head tied unless the config
says otherwise. Transformers' implementation calls no ``AttentionInterface``, so the backend
cannot run it: this file does."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.fairseq import gelu_approximation
from engine.models.fused_qkv import split_per_head
from engine.models.mlp import GeluMLP
from engine.models.rotary import RotaryEmbedding

# Checkpoint names (``gpt_neox_japanese.`` dropped) -> ours (``checkpoint_names.renamed``).
_NAMES = (
    ("embed_in.", "embed_tokens."),
    ("final_layer_norm.", "norm."),
    ("embed_out.", "lm_head."),
    (".attention.dense_bias", ".self_attn.o_proj.bias"),
    (".attention.dense.", ".self_attn.o_proj."),
    (".attention.", ".self_attn."),
)


class GPTNeoXJapaneseLayer(nn.Module):
    """``x + attn(ln(x))``, then ``+ mlp(ln(.))``; residuals added here."""

    def __init__(self, config, rotary_dim: int, last: bool, backend: str) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = Attention(
            hidden, heads, heads, hidden // heads, backend,
            AttentionOptions(o_bias=last, rotary_dim=rotary_dim),
        )  # fmt: skip
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        ffn = int(hidden * config.intermediate_multiple_size)
        self.mlp = GeluMLP(hidden, ffn, False, gelu_approximation(config, "hidden_act"))

    def forward(self, rope, hidden, residual, kv_cache, meta):
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), None


class GPTNeoXJapaneseForCausalLM(CausalLM):
    """GPT-NeoX-Japanese."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_position)
        self.rotaries["default"] = rotary
        for i in range(config.num_hidden_layers):
            last = i == config.num_hidden_layers - 1
            layer = GPTNeoXJapaneseLayer(config, rotary.rotary_dim, last, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(renamed(name.removeprefix("gpt_neox_japanese."), _NAMES))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``query_key_value`` (q, k, v per head) split."""
        heads = self.config.num_attention_heads
        super().load_weights(split_per_head(weights, "query_key_value", heads))

"""BLOOM (``bloom``, BigScience 560M-176B; BLOOMZ): ALiBi instead of positions (``alibi.py``),
a LayerNorm right after the token embeddings, LayerNorm-first blocks with biases everywhere,
q/k/v fused per head in ``query_key_value`` (split at load), a tanh-GeLU MLP of BLOOM's own
constants, the head tied to the embeddings. ``apply_residual_connection_post_layernorm``
takes each residual from the norm's output instead of its input. Transformers' BLOOM calls no
``AttentionInterface``, so the backend cannot run it: this file does."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.alibi import bloom_slopes
from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.fused_qkv import split_per_head
from engine.models.mlp import GeluMLP

# Checkpoint names (``transformer.`` dropped) -> ours (``checkpoint_names.renamed``).
_NAMES = (
    ("word_embeddings_layernorm.", "embed_layernorm."),
    ("word_embeddings.", "embed_tokens."),
    ("h.", "layers."),
    ("ln_f.", "norm."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".self_attention.", ".self_attn."),
)


class BloomMLP(GeluMLP):
    """``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` with BLOOM's tanh-GeLU, whose constant
    ``0.79788456`` stands for ``sqrt(2 / pi)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense_h_to_4h(x)
        return self.dense_4h_to_h(
            h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h)))
        )


class BloomBlock(nn.Module):
    """``x + attn(ln(x))``, then ``+ mlp(ln(.))``, each residual the norm's input (or output)."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.n_head, config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = Attention(
            hidden, heads, heads, hidden // heads, backend,
            AttentionOptions(qkv_bias=True, o_bias=True,
                             alibi_slopes=tuple(bloom_slopes(heads))),
        )  # fmt: skip
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = BloomMLP(hidden, 4 * hidden, True)
        self.residual_post_norm = bool(config.apply_residual_connection_post_layernorm)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        normed = self.input_layernorm(hidden)
        residual = normed if self.residual_post_norm else hidden
        hidden = residual + self.self_attn(None, normed, kv_cache, meta)
        normed = self.post_attention_layernorm(hidden)
        residual = normed if self.residual_post_norm else hidden
        return residual + self.mlp(normed), None


class BloomForCausalLM(CausalLM):
    """BLOOM."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.embed_layernorm = nn.LayerNorm(hidden, eps=eps)
        for _ in range(config.n_layer):
            layer = BloomBlock(config, backend)
            layer.rope_key = None
            self.layers.append(layer)
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_layernorm(self.embed_tokens(input_ids))

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(renamed(name.removeprefix("transformer."), _NAMES))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``query_key_value`` (q, k, v per head) split."""
        super().load_weights(split_per_head(weights, "query_key_value", self.config.n_head))

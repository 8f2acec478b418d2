"""GPT-Neo (``gpt_neo``, EleutherAI 125M / 1.3B / 2.7B): learned absolute positions added to the
embeddings, LayerNorm-first blocks with a GeLU (tanh) MLP, attention without the
``head_dim ** -0.5`` scale, global and local layers alternating (``attention_layers``; a local
layer sees the last ``window_size`` positions). Transformers' GPT-Neo calls no
``AttentionInterface``, so the backend cannot run it: this file does."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.mlp import GeluMLP

# Checkpoint names (``transformer.`` dropped) -> ours (``checkpoint_names.renamed``).
_NAMES = (
    ("wte.", "embed_tokens."),
    ("wpe.", "embed_positions."),
    ("h.", "layers."),
    ("ln_f.", "norm."),
    (".attn.attention.out_proj.", ".self_attn.o_proj."),
    (".attn.attention.", ".self_attn."),
    (".mlp.c_fc.", ".mlp.dense_h_to_4h."),
    (".mlp.c_proj.", ".mlp.dense_4h_to_h."),
)


class GPTNeoBlock(nn.Module):
    """``x + attn(ln_1(x))``, then ``+ mlp(ln_2(x))``; residuals added here."""

    def __init__(self, config, layer_idx: int, max_position: int, backend: str) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_heads, config.layer_norm_epsilon
        local = config.attention_layers[layer_idx] == "local"
        window = config.window_size if local and config.window_size < max_position else None
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = Attention(
            hidden, heads, heads, hidden // heads, backend,
            AttentionOptions(o_bias=True, scale=1.0, sliding_window=window),
        )  # fmt: skip
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GeluMLP(hidden, config.intermediate_size or 4 * hidden, True, "tanh")

    def forward(self, rope, hidden, residual, kv_cache, meta):
        hidden = hidden + self.self_attn(None, self.ln_1(hidden), kv_cache, meta)
        return hidden + self.mlp(self.ln_2(hidden)), None


class GPTNeoForCausalLM(CausalLM):
    """GPT-Neo."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        if config.activation_function != "gelu_new":
            raise ValueError(
                f"activation_function={config.activation_function!r} is not supported: "
                "GPT-Neo runs with 'gelu_new'"
            )
        super().__init__(config, max_position, backend)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        for i in range(config.num_layers):
            layer = GPTNeoBlock(config, i, max_position, backend)
            layer.rope_key = None
            self.layers.append(layer)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("transformer.")
        if ".attn.attention.bias" in name or ".attn.attention.masked_bias" in name:
            return None  # old checkpoints' causal-mask buffers
        return super().checkpoint_name(renamed(name, _NAMES))

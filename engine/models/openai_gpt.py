"""GPT-1 (``openai-gpt``, OpenAI 2018): learned absolute positions added to the token
embeddings, post-LayerNorm blocks (``ln_1(x + attn(x))``, then ``ln_2(n + mlp(n))``) and no
final norm, attention with biases and the usual scale, a tanh-GeLU MLP, the head tied to the
embeddings. Its checkpoints keep GPT-2's ``Conv1D`` weights (``[in, out]``, q/k/v fused in
``c_attn``): transposed and split at load. Transformers' GPT-1 calls no
``AttentionInterface``, so the backend cannot run it: this file does."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.mlp import GeluMLP

# Checkpoint names (``transformer.`` dropped) -> ours (``checkpoint_names.renamed``).
_NAMES = (
    ("tokens_embed.", "embed_tokens."),
    ("positions_embed.", "embed_positions."),
    ("h.", "layers."),
    (".attn.c_proj.", ".self_attn.o_proj."),
    (".mlp.c_fc.", ".mlp.dense_h_to_4h."),
    (".mlp.c_proj.", ".mlp.dense_4h_to_h."),
)


class OpenAIGPTBlock(nn.Module):
    """``n = ln_1(x + attn(x))``, ``ln_2(n + mlp(n))``; residuals added here."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        hidden, heads, eps = config.n_embd, config.n_head, config.layer_norm_epsilon
        self.self_attn = Attention(
            hidden, heads, heads, hidden // heads, backend,
            AttentionOptions(qkv_bias=True, o_bias=True),
        )  # fmt: skip
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GeluMLP(hidden, 4 * hidden, True, "tanh")
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        hidden = self.ln_1(hidden + self.self_attn(None, hidden, kv_cache, meta))
        return self.ln_2(hidden + self.mlp(hidden)), None


class OpenAIGPTLMHeadModel(CausalLM):
    """GPT-1."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        if config.afn != "gelu":
            raise ValueError(
                f"afn={config.afn!r} is not supported: GPT-1 runs with 'gelu' (tanh GeLU)"
            )
        super().__init__(config, max_position, backend)
        self.embed_positions = nn.Embedding(config.n_positions, config.n_embd)
        for _ in range(config.n_layer):
            layer = OpenAIGPTBlock(config, backend)
            layer.rope_key = None
            self.layers.append(layer)
        self.norm = nn.Identity()  # post-norm blocks: the last one's ln_2 is the final norm

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(renamed(name.removeprefix("transformer."), _NAMES))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``Conv1D`` weights transposed to ``nn.Linear``'s, ``c_attn`` split into q, k, v."""
        super().load_weights(self._linear_layout(weights))

    @staticmethod
    def _linear_layout(weights):
        for name, tensor in weights:
            conv = name.endswith(".weight") and (".attn." in name or ".mlp." in name)
            if conv:
                tensor = tensor.t()
            if ".attn.c_attn." in name:
                for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                    yield name.replace(".attn.c_attn.", f".self_attn.{part}."), t.contiguous()
                continue
            yield name, tensor.contiguous() if conv else tensor

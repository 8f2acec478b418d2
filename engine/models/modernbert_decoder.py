"""ModernBERT's decoder (``modernbert-decoder``: the Ettin decoders, 17M-1B): a LayerNorm on the
embeddings, LayerNorm-first blocks (none before the first layer's attention), global and local
layers (``layer_types``; a local layer sees the last ``local_attention // 2`` positions) with a
RoPE base per type, a GeGLU MLP fused in ``Wi`` (``[act half | gate half]``), a final norm; the
logits through BERT's prediction head (dense, activation, LayerNorm), then the tied decoder with
its bias. The backend cannot run it (transformers' head is not a plain LM head over the base
model's output): this file does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.fairseq import gelu_approximation
from engine.models.mlp import GatedMLP
from engine.models.rotary import RotaryEmbedding

SLIDING = "sliding_attention"
# Checkpoint names (``model.`` dropped) -> ours (``checkpoint_names.renamed``).
_NAMES = (
    ("embeddings.tok_embeddings.", "embed_tokens."),
    ("embeddings.norm.", "embed_norm."),
    ("final_norm.", "norm."),
    ("lm_head.", "head_transform."),
    ("decoder.bias", "decoder_bias"),
    ("decoder.", "lm_head."),
    (".attn.Wo.", ".self_attn.o_proj."),
    (".attn.", ".self_attn."),
    (".mlp.Wi.", ".mlp.gate_up_proj."),
    (".mlp.Wo.", ".mlp.down_proj."),
)


class ModernBertDecoderLayer(nn.Module):
    """``x + attn(norm(x))`` (no norm in layer 0), then ``+ mlp(norm(.))``; residuals here."""

    def __init__(self, config, layer_idx: int, max_position: int, backend: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        eps, norm_bias = config.norm_eps, bool(config.norm_bias)
        self.attn_norm = (
            nn.LayerNorm(hidden, eps=eps, bias=norm_bias) if layer_idx else nn.Identity()
        )
        window = config.sliding_window if config.layer_types[layer_idx] == SLIDING else None
        bias = bool(config.attention_bias)
        self.self_attn = Attention(
            hidden, heads, heads, hidden // heads, backend,
            AttentionOptions(qkv_bias=bias, o_bias=bias,
                             sliding_window=window if window and window < max_position else None),
        )  # fmt: skip
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        act = config.hidden_activation
        act = act if act in ("gelu", "gelu_pytorch_tanh") else "silu" if act == "silu" else act
        self.mlp = GatedMLP(
            hidden, config.intermediate_size, backend, bool(config.mlp_bias), activation=act
        )

    def forward(self, rope, hidden, residual, kv_cache, meta):
        hidden = hidden + self.self_attn(rope, self.attn_norm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.mlp_norm(hidden)), None


class ModernBertDecoderForCausalLM(CausalLM):
    """ModernBERT's decoder with BERT's prediction head before the tied, biased decoder."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, eps, norm_bias = config.hidden_size, config.norm_eps, bool(config.norm_bias)
        head_dim = hidden // config.num_attention_heads
        for layer_type in sorted(set(config.layer_types)):
            self.rotaries[layer_type] = RotaryEmbedding(
                config, head_dim, max_position, layer_type=layer_type
            )
        self.embed_norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        for i in range(config.num_hidden_layers):
            layer = ModernBertDecoderLayer(config, i, max_position, backend)
            layer.rope_key = config.layer_types[i]
            self.layers.append(layer)
        self.norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        self.head_transform = nn.Module()
        self.head_transform.dense = nn.Linear(hidden, hidden, bias=bool(config.classifier_bias))
        self.head_transform.norm = nn.LayerNorm(hidden, eps=eps, bias=norm_bias)
        self.head_approximate = gelu_approximation(config, "classifier_activation")
        self.decoder_bias = (
            nn.Parameter(torch.zeros(config.vocab_size)) if config.decoder_bias else None
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(self.embed_tokens(input_ids))

    def _transform(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head_transform
        return head.norm(F.gelu(head.dense(hidden), approximate=self.head_approximate))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(self._transform(hidden))
        return logits if self.decoder_bias is None else logits + self.decoder_bias.float()

    def greedy_token_ids(self, hidden: torch.Tensor) -> list[int] | None:
        if self.decoder_bias is not None:  # the bias moves the argmax: logits first
            return None
        return super().greedy_token_ids(self._transform(hidden))

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(renamed(name, _NAMES))

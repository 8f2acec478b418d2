"""MPT (``mpt``, MosaicML 7B / 30B and their instruct and chat tunes): ALiBi instead of positions
(``alibi.py``, ``attn_config.alibi_bias_max``), bias-free LayerNorms and linears, q/k/v fused in
``Wqkv`` (split at load), optionally clamped to ``attn_config.clip_qkv``, a GeLU MLP of 4x the
hidden size, the head tied to the embeddings; ``attn_config.softmax_scale`` where it is set.
As in transformers, every model is ALiBi and multi-head whatever ``attn_config`` says
otherwise. Transformers' MPT calls no ``AttentionInterface``, so the backend cannot run it:
this file does."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.alibi import mpt_slopes
from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.mlp import GeluMLP

# Checkpoint names (``transformer.`` dropped) -> ours (``checkpoint_names.renamed``).
_NAMES = (
    ("wte.", "embed_tokens."),
    ("blocks.", "layers."),
    ("norm_f.", "norm."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".attn.", ".self_attn."),
    (".ffn.up_proj.", ".mlp.dense_h_to_4h."),
    (".ffn.down_proj.", ".mlp.dense_4h_to_h."),
)


def _attn_config(config, field: str, default):
    attn = config.attn_config
    return attn.get(field, default) if isinstance(attn, dict) else getattr(attn, field, default)


class MptAttention(Attention):
    """Multi-head attention with ALiBi, q/k/v clamped to ``clip_qkv`` where it is set."""

    def __init__(self, config, backend: str) -> None:
        hidden, heads = config.d_model, config.n_heads
        options = AttentionOptions(
            scale=_attn_config(config, "softmax_scale", None),
            alibi_slopes=tuple(mpt_slopes(heads, _attn_config(config, "alibi_bias_max", 8))),
        )
        super().__init__(hidden, heads, heads, hidden // heads, backend, options)
        self.clip_qkv = _attn_config(config, "clip_qkv", None)

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        return qkv if self.clip_qkv is None else qkv.clamp(-self.clip_qkv, self.clip_qkv)


class MptBlock(nn.Module):
    """``x + attn(norm_1(x))``, then ``+ ffn(norm_2(.))``; residuals added here."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        hidden, eps = config.d_model, config.layer_norm_epsilon
        self.norm_1 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.self_attn = MptAttention(config, backend)
        self.norm_2 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.mlp = GeluMLP(hidden, 4 * hidden, False)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        hidden = hidden + self.self_attn(None, self.norm_1(hidden), kv_cache, meta)
        return hidden + self.mlp(self.norm_2(hidden)), None


class MptForCausalLM(CausalLM):
    """MPT."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        for _ in range(config.n_layers):
            layer = MptBlock(config, backend)
            layer.rope_key = None
            self.layers.append(layer)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(renamed(name.removeprefix("transformer."), _NAMES))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``Wqkv`` (q, then k, then v) split."""
        super().load_weights(self._split_qkv(weights))

    @staticmethod
    def _split_qkv(weights):
        for name, tensor in weights:
            if ".Wqkv." not in name:
                yield name, tensor
                continue
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                yield name.replace(".Wqkv.", f".{part}."), t.contiguous()

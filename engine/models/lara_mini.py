"""Lara-Mini (``lara_mini``): Qwen3.5's Gated DeltaNet layers (``qwen3_5.py``) beside Qwen3
attention with per-head QK-norm, windowed and rotated on ``"sliding_attention"`` layers, without
positions on ``"full_attention"`` ones; plain RMSNorms (the scale applied in fp32); in every layer
softmax-routed experts (fp32 logits, renormalised, weights rounded to the model's dtype) plus an
ungated shared expert. Released checkpoints keep the delta net's input projections in one
``in_proj`` (our layout) and name its gated norm ``out_norm``."""

from __future__ import annotations

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import PACKED_MODULES
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.hybrid import HybridLayers
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.qwen3_5 import LINEAR, GatedDeltaNet
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router

SLIDING = "sliding_attention"


class LaraMiniForCausalLM(HybridLayers, MoECausalLM):
    """Lara-Mini's hybrid stack: delta-net and attention layers, experts in every layer."""

    packed_modules = {
        **PACKED_MODULES,
        **{f"in_proj_{p}": ("in_proj", p) for p in ("qkv", "z", "b", "a")},
    }

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, eps, head_dim = config.hidden_size, config.rms_norm_eps, head_dim_of(config)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        for layer_type in config.layer_types:
            if layer_type == LINEAR:
                mixer = GatedDeltaNet(config, backend)
            else:
                window = config.sliding_window if layer_type == SLIDING else None
                opts = AttentionOptions(qk_norm="head", norm_eps=eps, sliding_window=window)
                mixer = Attention(
                    hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim,
                    backend, opts,
                )  # fmt: skip
            layer = DecoderLayer(mixer, self.make_moe(config), hidden, eps, backend)
            layer.rope_key = "default" if layer_type == SLIDING else None
            self.layers.append(layer)
        self.norm = self.make_norm()

    def make_moe(self, config) -> FusedMoE:
        """Softmax-routed experts beside a shared expert added in full."""
        hidden, experts, top_k = config.hidden_size, config.num_experts, config.num_experts_per_tok
        gate = Router(hidden, experts, top_k, renormalize=config.norm_topk_prob,
                      round_weights=True)  # fmt: skip
        shared = GatedMLP(hidden, config.shared_expert_intermediate_size, self.backend)
        return FusedMoE(
            experts, top_k, hidden, config.moe_intermediate_size, gate, backend=self.backend,
            shared_expert=shared,
        )  # fmt: skip

    def checkpoint_name(self, name: str) -> str | None:
        name = name.replace(".linear_attn.out_norm.", ".linear_attn.norm.", 1)
        return super().checkpoint_name(name.replace(".linear_attn.", ".self_attn."))

"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen3-MoE's layers with Qwen2's attention (q/k/v
biases, no QK-norm) and a shared expert beside the routed ones, scaled by
``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from engine.models.attention import AttentionOptions
from engine.models.config_fields import layer_sliding_window
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE
from engine.models.qwen3_moe import Qwen3MoeForCausalLM


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2's attention; routed experts and a gated shared expert."""

    @staticmethod
    def attention_options(config, i: int, max_position: int) -> AttentionOptions:
        return AttentionOptions(
            qkv_bias=bool(getattr(config, "qkv_bias", True)),
            sliding_window=layer_sliding_window(config, i, max_position),
        )

    @staticmethod
    def make_moe(config, backend: str, shared_expert=None) -> FusedMoE:
        shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, backend)
        return Qwen3MoeForCausalLM.make_moe(config, backend, shared)

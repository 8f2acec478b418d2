"""GLM-4.5 / 4.6 (``glm4_moe``): partial rotary (``partial_rotary_factor``), q/k/v biases,
optional per-head QK-norm; dense SwiGLU in the first ``first_k_dense_replace`` layers, then
experts routed by grouped sigmoid scores with a correction bias (DeepSeek-V3's routing) beside
a plain shared expert."""

from __future__ import annotations

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.rotary import RotaryEmbedding, rope_parameters
from engine.models.routers import Router


def grouped_sigmoid_router(config, num_experts: int) -> Router:
    """DeepSeek-V3's router as its descendants configure it: grouped sigmoid scores with a
    correction bias, fp32 (GLM-4.5, MiMo-V2-Flash)."""
    return Router(
        config.hidden_size, num_experts, config.num_experts_per_tok,
        scoring="grouped_topk_sigmoid", renormalize=config.norm_topk_prob,
        n_group=config.n_group, topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor, fp32_weights=True,
    )  # fmt: skip


class Glm4MoeForCausalLM(MoECausalLM):
    """GLM-4.5's block: dense first layers, then routed and shared experts."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        # transformers 5 keeps the factor in rope_parameters, older configs beside them.
        factor = rope_parameters(config).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        rotary_dim = int(head_dim * factor)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position, rotary_dim)
        hidden = config.hidden_size
        for i in range(config.num_hidden_layers):
            options = AttentionOptions(
                qkv_bias=bool(getattr(config, "attention_bias", False)),
                qk_norm="head" if getattr(config, "use_qk_norm", False) else None,
                norm_eps=config.rms_norm_eps,
                rotary_dim=rotary_dim,
            )
            attn = Attention(
                hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim, backend,
                options,
            )  # fmt: skip
            if i >= config.first_k_dense_replace:
                mlp = self.make_moe(config, backend)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size, backend)
            layer = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

    @staticmethod
    def make_moe(config, backend: str, num_experts: int | None = None) -> FusedMoE:
        """Routed experts (grouped sigmoid routing in fp32) and the shared expert of
        ``moe_intermediate_size * n_shared_experts``; ``num_experts`` where the config names
        it otherwise than ``n_routed_experts`` (Kimi Linear's ``num_experts``)."""
        hidden, top_k = config.hidden_size, config.num_experts_per_tok
        experts = config.n_routed_experts if num_experts is None else num_experts
        gate = grouped_sigmoid_router(config, experts)
        inter = config.moe_intermediate_size
        shared = GatedMLP(hidden, inter * config.n_shared_experts, backend)
        return FusedMoE(experts, top_k, hidden, inter, gate, shared_expert=shared, backend=backend)

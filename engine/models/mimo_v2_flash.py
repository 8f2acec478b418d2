"""MiMo-V2-Flash (``mimo_v2_flash``, Xiaomi): sliding-window layers (twice the KV heads, a sink
logit per head) beside full-attention layers, each type with its RoPE base over the first third
of a head (``partial_rotary_factor`` 0.334); values narrower than keys (``v_head_dim``) and
scaled by ``attention_value_scale``; a dense first MLP, then routed experts under DeepSeek-V3's
grouped sigmoid routing, with no shared expert."""

from __future__ import annotations

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import layer_sliding_window
from engine.models.decoder import DecoderLayer
from engine.models.glm4_moe import grouped_sigmoid_router
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.rotary import RotaryEmbedding, rope_parameters

# transformers' rotary for this family rotates a third of a head where the config says nothing.
DEFAULT_PARTIAL_ROTARY = 0.334


class MiMoV2FlashForCausalLM(MoECausalLM):
    """MiMo-V2-Flash's block."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim, hidden = config.head_dim, config.hidden_size
        for layer_type in sorted(set(config.layer_types)):
            factor = rope_parameters(config, layer_type).get(
                "partial_rotary_factor", DEFAULT_PARTIAL_ROTARY
            )
            self.rotaries[layer_type] = RotaryEmbedding(
                config, head_dim, max_position, int(head_dim * factor), layer_type
            )
        for i, layer_type in enumerate(config.layer_types):
            sliding = layer_type == "sliding_attention"
            options = AttentionOptions(
                qkv_bias=config.attention_bias,
                rotary_dim=self.rotaries[layer_type].rotary_dim,
                sliding_window=layer_sliding_window(config, i, max_position),
                sinks=sliding,
                v_head_dim=config.v_head_dim,
                value_scale=config.attention_value_scale,
            )
            kv_heads = config.num_key_value_heads * (2 if sliding else 1)
            attn = Attention(
                hidden, config.num_attention_heads, kv_heads, head_dim, backend, options
            )
            if config.mlp_layer_types[i] == "sparse":
                mlp = self.make_moe(config, backend)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size, backend)
            layer = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, backend)
            layer.rope_key = layer_type
            self.layers.append(layer)
        self.norm = self.make_norm()

    def checkpoint_name(self, name: str) -> str | None:
        # Released checkpoints name the sinks as transformers' original format saves them.
        return super().checkpoint_name(name.replace(".attention_sink_bias", ".sinks"))

    @staticmethod
    def make_moe(config, backend: str) -> FusedMoE:
        """Routed experts under grouped sigmoid routing with a correction bias (fp32)."""
        experts = config.n_routed_experts
        return FusedMoE(
            experts, config.num_experts_per_tok, config.hidden_size,
            config.moe_intermediate_size, grouped_sigmoid_router(config, experts), backend=backend,
        )  # fmt: skip

"""Mixtral: Mistral's attention (sliding window where the config sets one) and a mixture of
experts in every layer (softmax over the experts, the top k, always renormalised; weights kept
in fp32)."""

from __future__ import annotations

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import head_dim_of, layer_sliding_window, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router


class MixtralForCausalLM(MoECausalLM):
    """Mistral's block with routed experts in place of the MLP."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        hidden, experts, top_k = (
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
        )
        for i in range(config.num_hidden_layers):
            options = AttentionOptions(sliding_window=layer_sliding_window(config, i, max_position))
            attn = Attention(
                hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim, backend,
                options,
            )  # fmt: skip
            gate = Router(hidden, experts, top_k, renormalize=True)
            mlp = FusedMoE(experts, top_k, hidden, config.intermediate_size, gate, backend=backend)
            layer = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

"""Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (per-head QK-norm), SmolLM: the dense block of
2024, composed from the shared layers."""

from __future__ import annotations

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.config_fields import head_dim_of, layer_sliding_window, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.mlp import GatedMLP
from engine.models.rotary import RotaryEmbedding


class LlamaForCausalLM(CausalLM):
    """Pre-norm attention and SwiGLU blocks with residuals."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        for i in range(config.num_hidden_layers):
            options = AttentionOptions(
                qkv_bias=qkv_bias,
                qk_norm="head" if config.model_type == "qwen3" else None,
                norm_eps=config.rms_norm_eps,
                sliding_window=layer_sliding_window(config, i, max_position),
            )
            attn = Attention(
                config.hidden_size,
                config.num_attention_heads,
                num_kv_heads_of(config),
                head_dim,
                backend,
                options,
            )
            mlp = GatedMLP(
                config.hidden_size,
                config.intermediate_size,
                backend,
                bias=bool(getattr(config, "mlp_bias", False)),
            )
            layer = DecoderLayer(attn, mlp, config.hidden_size, config.rms_norm_eps, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

"""Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (per-head QK-norm), Phi-3/4 (the same block with
fused checkpoint projections and partial rotary), SmolLM: the dense block of 2024, composed
from the shared layers.

Later dense families subclass it and override the hooks (``attention_options``, ``make_mlp``,
``norm_style``, ``unit_offset``) with what they add.
"""

from __future__ import annotations

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.config_fields import head_dim_of, layer_sliding_window, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.mlp import GatedMLP
from engine.models.rotary import make_rotaries, rope_key


class LlamaForCausalLM(CausalLM):
    """Pre-norm attention and SwiGLU blocks with residuals."""

    norm_style = "pre"  # where the block's norms sit (engine/models/decoder.py)
    unit_offset = False  # RMSNorm scales by 1 + w (Gemma)

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        self.rotaries = make_rotaries(config, head_dim_of(config), max_position)
        for i in range(config.num_hidden_layers):
            layer = DecoderLayer(
                self.make_attention(i),
                self.make_mlp(i),
                config.hidden_size,
                config.rms_norm_eps,
                backend,
                self.norm_style,
                self.unit_offset,
            )
            layer.rope_key = rope_key(config, i)
            self.layers.append(layer)
        self.norm = self.make_norm(self.unit_offset)

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        """The options of layer ``layer_idx``'s attention."""
        config = self.config
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(
            qkv_bias=bias or config.model_type == "qwen2",
            o_bias=bias,
            qk_norm="head" if config.model_type == "qwen3" else None,
            norm_eps=config.rms_norm_eps,
            rotary_dim=self.rotaries[rope_key(config, layer_idx)].rotary_dim,
            sliding_window=layer_sliding_window(config, layer_idx, self.max_position),
        )

    def make_attention(self, layer_idx: int) -> Attention:
        """Layer ``layer_idx``'s attention."""
        config = self.config
        return Attention(
            config.hidden_size,
            config.num_attention_heads,
            num_kv_heads_of(config),
            head_dim_of(config),
            self.backend,
            self.attention_options(layer_idx),
        )

    def make_mlp(self, layer_idx: int) -> GatedMLP:
        """Layer ``layer_idx``'s feed-forward block."""
        config = self.config
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            self.backend,
            bias=bool(getattr(config, "mlp_bias", False)),
            activation=getattr(config, "hidden_activation", None) or config.hidden_act,
        )

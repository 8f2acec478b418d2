"""Liquid AI's LFM3 (``lfm3``): LFM2's hybrid block (``lfm2.py``: gated short convolutions beside
attention with per-head QK-norm) with sliding-window attention layers beside the full ones, a
RoPE per layer type (full layers: ``proportional``, half the features rotated), a sigmoid gate
per head on the attention output (``g_proj``, from the layer's input) and, with
``use_sandwich_norm``, a norm on each mixer's and MLP's output before the residual sum."""

from __future__ import annotations

from engine.models.attention import AttentionOptions
from engine.models.config_fields import head_dim_of
from engine.models.lfm2 import Lfm2ForCausalLM
from engine.models.rotary import make_rotaries, rope_key

SLIDING = "sliding_attention"
# Checkpoint names -> ours under sandwich norms, before LFM2's own renames.
_SANDWICH_RENAMES = (
    (".post_operator_norm.", ".post_attention_layernorm."),
    (".ffn_norm.", ".pre_feedforward_layernorm."),
    (".post_ffn_norm.", ".post_feedforward_layernorm."),
)


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """LFM3: LFM2's stack with windows, per-type RoPE, head gates and sandwich norms."""

    @staticmethod
    def norm_style(config) -> str:
        return "sandwich" if config.use_sandwich_norm else "pre"

    def make_rotaries(self, config, max_position: int) -> None:
        self.rotaries.update(make_rotaries(config, head_dim_of(config), max_position))

    def rope_key(self, i: int) -> str:
        return rope_key(self.config, i)

    def attention_options(self, config, i: int) -> AttentionOptions:
        window = config.sliding_window if config.layer_types[i] == SLIDING else None
        return AttentionOptions(
            qk_norm="head", norm_eps=config.norm_eps, sliding_window=window,
            head_gate=bool(config.use_attention_gate), qkv_bias=bool(config.attention_bias),
            o_bias=bool(config.attention_bias),
        )  # fmt: skip

    def checkpoint_name(self, name: str) -> str | None:
        # Released checkpoints name the head gate gate_proj (transformers renames it g_proj).
        name = name.replace(".self_attn.gate_proj.", ".self_attn.g_proj.", 1)
        if self.config.use_sandwich_norm:
            for theirs, ours in _SANDWICH_RENAMES:
                name = name.replace(theirs, ours, 1)
        return super().checkpoint_name(name)

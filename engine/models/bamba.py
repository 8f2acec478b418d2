"""IBM's Bamba (``bamba``), the model Granite 4.0-H grew from: pre-norm blocks whose token
mixer is a Mamba-2 layer (engine/models/mamba2.py) or, at ``attn_layer_indices``, full
attention with half the head dims rotated; a SwiGLU MLP in every block. No multipliers, no
experts."""

from __future__ import annotations

from engine.models.attention import AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.config_fields import head_dim_of
from engine.models.decoder import DecoderLayer
from engine.models.granitemoehybrid import token_mixer
from engine.models.hybrid import HybridLayers
from engine.models.mlp import GatedMLP
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding, rope_parameters

_RENAMES = (
    (".mamba.", ".self_attn."),
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
)


def mamba_block_name(name: str) -> str:
    """A Bamba- or Jamba-style checkpoint name (``mamba``, ``feed_forward``,
    ``pre_ff_layernorm``, ``final_layernorm``) in a ``DecoderLayer`` stack's terms."""
    if name.endswith("final_layernorm.weight"):
        name = name.replace("final_layernorm", "norm")
    for theirs, ours in _RENAMES:
        name = name.replace(theirs, ours)
    return name


class BambaForCausalLM(HybridLayers, CausalLM):
    """Bamba's stack: Mamba-2 and partial-RoPE attention layers, SwiGLU MLPs."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim, hidden, eps = head_dim_of(config), config.hidden_size, config.rms_norm_eps
        factor = rope_parameters(config).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        rotary_dim = int(head_dim * factor)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position, rotary_dim)
        bias = bool(config.attention_bias)
        opts = AttentionOptions(qkv_bias=bias, o_bias=bias, rotary_dim=rotary_dim)
        for layer_type in config.layers_block_type:
            mlp = GatedMLP(hidden, config.intermediate_size, backend, bool(config.mlp_bias))
            mixer = token_mixer(config, layer_type, opts, backend)
            layer = DecoderLayer(mixer, mlp, hidden, eps, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = RMSNorm(hidden, eps, backend)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(mamba_block_name(name))

"""IBM's Granite 4.0-H (``granitemoehybrid``): pre-norm blocks whose token mixer is, per
``config.layer_types``, a Mamba-2 layer (``"linear_attention"``; engine/models/mamba2.py) or
full attention (RoPE only with ``position_embedding_type="rope"``, else none), each followed by
routed experts plus a shared SwiGLU MLP (the MLP alone when ``num_local_experts`` is 0).

Granite's multipliers: embeddings times ``embedding_multiplier``, every block's output times
``residual_multiplier`` before its residual add, attention scores times
``attention_multiplier`` (the softmax scale), logits divided by ``logits_scaling``. The router
takes the top k logits and a softmax over them.
"""

from __future__ import annotations

from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.hybrid import HybridLayers
from engine.models.mamba2 import Mamba2Mixer
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router

MAMBA = "linear_attention"

# Checkpoint names -> ours, in order: Granite's first layout (``input_linear`` /
# ``output_linear`` of the experts and the shared MLP) and transformers 5's.
_RENAMES = (
    (".mamba.", ".self_attn."),
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
)


def mamba_mixer(config, backend: str) -> Mamba2Mixer:
    """Granite 4.0-H's (and Bamba's) Mamba-2 layer from the ``mamba_*`` config fields."""
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: must be 'silu'")
    return Mamba2Mixer(
        config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
        config.mamba_d_state, config.mamba_d_conv, config.rms_norm_eps, backend,
        conv_bias=bool(config.mamba_conv_bias), proj_bias=bool(config.mamba_proj_bias),
        time_step_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
    )  # fmt: skip


def token_mixer(config, layer_type: str, opts: AttentionOptions, backend: str) -> nn.Module:
    """A Mamba-2 layer for ``"linear_attention"``, else attention with ``opts``."""
    if layer_type == MAMBA:
        return mamba_mixer(config, backend)
    return Attention(
        config.hidden_size, config.num_attention_heads, num_kv_heads_of(config),
        head_dim_of(config), backend, opts,
    )  # fmt: skip


class GraniteMoeHybridForCausalLM(HybridLayers, MoECausalLM):
    """Granite 4.0-H's stack: Mamba-2 and attention layers, experts and a shared MLP."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim, hidden, eps = head_dim_of(config), config.hidden_size, config.rms_norm_eps
        rope = config.position_embedding_type == "rope"
        if rope:
            self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        self.layer_types = list(config.layer_types)
        residual_multiplier = float(config.residual_multiplier)
        opts = AttentionOptions(
            qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
            scale=float(config.attention_multiplier),
        )  # fmt: skip
        for layer_type in self.layer_types:
            layer = DecoderLayer(
                token_mixer(config, layer_type, opts, backend), self.make_mlp(config), hidden,
                eps, backend,
                residual_multiplier=None if residual_multiplier == 1.0 else residual_multiplier,
            )  # fmt: skip
            layer.rope_key = "default" if rope else None
            self.layers.append(layer)
        self.norm = RMSNorm(hidden, eps, backend)
        if config.embedding_multiplier != 1.0:
            self.embed_scale = float(config.embedding_multiplier)
        if config.logits_scaling != 1.0:
            self.logits_scale = 1.0 / float(config.logits_scaling)

    def make_mlp(self, config) -> nn.Module:
        """Experts plus the shared MLP, or the shared MLP alone."""
        shared = GatedMLP(config.hidden_size, config.shared_intermediate_size, self.backend)
        if not config.num_local_experts:
            return shared
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        gate = Router(config.hidden_size, experts, top_k, scoring="topk_softmax",
                      round_weights=True)  # fmt: skip
        return FusedMoE(
            experts, top_k, config.hidden_size, config.intermediate_size, gate,
            backend=self.backend, shared_expert=shared,
        )  # fmt: skip

    def checkpoint_name(self, name: str) -> str | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        shared = ".mlp.shared_expert." if self.config.num_local_experts else ".mlp."
        name = name.replace(".shared_mlp.input_linear.", f"{shared}gate_up_proj.")
        name = name.replace(".shared_mlp.output_linear.", f"{shared}down_proj.")
        return super().checkpoint_name(name)

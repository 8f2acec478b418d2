"""AI21's Jamba (``jamba``): pre-norm blocks whose token mixer is a Mamba-1 layer
(engine/models/mamba1.py, the time step, ``B`` and ``C`` RMS-normed with weights) or, once
every ``attn_layer_period`` layers, attention without positional encoding; the feed-forward
block is routed experts once every ``expert_layer_period`` layers (a softmax over all experts,
the top k kept as they are, not renormalised), else a SwiGLU MLP."""

from __future__ import annotations

from torch import nn

from engine.models.attention import Attention
from engine.models.bamba import mamba_block_name
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.hybrid import HybridLayers
from engine.models.mamba1 import MambaMixer
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.norm import RMSNorm
from engine.models.routers import Router


class JambaForCausalLM(HybridLayers, MoECausalLM):
    """Jamba's stack: Mamba-1 and attention layers, experts and SwiGLU MLPs."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: must be 'silu'")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        experts = config.layers_num_experts
        for i, kind in enumerate(config.layers_block_type):
            if kind == "mamba":
                mixer = MambaMixer(
                    hidden, config.mamba_expand * hidden, config.mamba_d_state,
                    config.mamba_d_conv, int(config.mamba_dt_rank), backend,
                    conv_bias=bool(config.mamba_conv_bias),
                    proj_bias=bool(config.mamba_proj_bias), bcdt_norm="weighted", norm_eps=eps,
                )  # fmt: skip
            elif kind == "attention":
                mixer = Attention(
                    hidden, config.num_attention_heads, num_kv_heads_of(config),
                    head_dim_of(config), backend,
                )  # fmt: skip
            else:
                raise ValueError(f"layers_block_type {kind!r} is not supported: must be "
                                 "'mamba' or 'attention'")  # fmt: skip
            layer = DecoderLayer(mixer, self.make_mlp(config, experts[i]), hidden, eps, backend)
            layer.rope_key = None  # Jamba's attention has no positional encoding
            self.layers.append(layer)
        self.norm = RMSNorm(hidden, eps, backend)

    def make_mlp(self, config, num_experts: int) -> nn.Module:
        """Routed experts where the layer has more than one, else a SwiGLU MLP."""
        hidden, inter = config.hidden_size, config.intermediate_size
        if num_experts <= 1:
            return GatedMLP(hidden, inter, self.backend)
        top_k = config.num_experts_per_tok
        gate = Router(hidden, num_experts, top_k, renormalize=False, round_weights=True)
        return FusedMoE(num_experts, top_k, hidden, inter, gate, backend=self.backend)

    def checkpoint_name(self, name: str) -> str | None:
        """Jamba's names (``mamba``, ``feed_forward``, ``pre_ff_layernorm``,
        ``final_layernorm``) -> ours."""
        return super().checkpoint_name(mamba_block_name(name))

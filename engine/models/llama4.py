"""Llama 4 (``llama4_text``; Scout and Maverick, whose multimodal wrapper ``llama4`` serves its
text model): Llama's pre-norm block with

- RoPE layers (``no_rope_layers[i]`` 1) whose features rotate in adjacent pairs (complex
  rotary), with a weightless L2 (RMS) norm on q and k (``use_qk_norm``) and chunked local
  attention: keys of the query's own ``attention_chunk_size`` chunk only;
- NoPE layers (every ``no_rope_layer_interval``-th), full attention without positions, each
  query scaled by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` at position p
  (``attn_temperature_tuning``);
- experts in the ``moe_layers`` (every ``interleave_moe_layer_step``-th): the top k router
  logits through a sigmoid, each weight scaling the expert's input, plus a shared expert; dense
  SwiGLU MLPs of ``intermediate_size_mlp`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router


class AttentionTemperature:
    """The NoPE layers' step tensors: no rotation, each token's query scale (fp32), as the
    third element ``Attention`` reads."""

    length_dependent = False

    def __init__(self, attn_scale: float, floor_scale: int) -> None:
        self.attn_scale, self.floor_scale = attn_scale, floor_scale

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, rope_lengths=None):
        """``(None, None, query_scale)`` of a step's ``positions``."""
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return None, None, torch.log1p(steps) * self.attn_scale + 1.0

    def to_device(self, device: torch.device) -> None:
        """Nothing is cached."""


class Llama4ForCausalLM(MoECausalLM):
    """Llama 4's text model."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        if config.attn_temperature_tuning:
            self.rotaries["nope"] = AttentionTemperature(config.attn_scale, config.floor_scale)
        hidden = config.hidden_size
        moe_layers = set(config.moe_layers)
        for i in range(config.num_hidden_layers):
            use_rope = bool(config.no_rope_layers[i])
            chunked = config.layer_types[i] == "chunked_attention"
            options = AttentionOptions(
                qkv_bias=config.attention_bias,
                o_bias=config.attention_bias,
                qk_norm="head" if config.use_qk_norm and use_rope else None,
                qk_norm_scale=False,
                norm_eps=config.rms_norm_eps,
                rope_interleave=True,
                attention_chunk_size=config.attention_chunk_size if chunked else None,
            )
            attn = Attention(
                hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim, backend,
                options,
            )  # fmt: skip
            if i in moe_layers:
                mlp = self.make_moe(config, backend)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size_mlp, backend)
            layer = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, backend)
            layer.rope_key = "default" if use_rope else "nope"
            self.layers.append(layer)
        self.norm = self.make_norm()

    @staticmethod
    def make_moe(config, backend: str) -> FusedMoE:
        """Sigmoid-routed experts that take their weight on the input, and the shared expert."""
        hidden, experts, top_k = (
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok
        )  # fmt: skip
        gate = Router(hidden, experts, top_k, scoring="topk_sigmoid", round_weights=True)
        shared = GatedMLP(hidden, config.intermediate_size, backend)
        return FusedMoE(
            experts, top_k, hidden, config.intermediate_size, gate, shared_expert=shared,
            backend=backend, router_weight_on_input=True,
        )  # fmt: skip

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(name.replace(".feed_forward.", ".mlp."))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama 4's fused experts are ``[E, in, out]``: transposed into ours."""
        super().load_weights((name, _expert_layout(name, t)) for name, t in weights)


def _expert_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    # gate_up_proj [E, H, 2I] (gate columns, then up) -> [E, 2I, H];
    # down_proj [E, I, H] -> [E, H, I]
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and tensor.dim() == 3:
        return tensor.transpose(1, 2).contiguous()
    return tensor

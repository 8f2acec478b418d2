"""Mistral 4 (``mistral4``, Mistral Small 4): DeepSeek-V3's block (``deepseek_v3.py``) with
softmax routing in groups (a group scored by its two best experts, the chosen weights
renormalised, times ``routed_scaling_factor``) and Llama 4's attention scaling: each token's
query is multiplied by ``1 + beta * log(1 + floor(position / original_max_position_embeddings))``
after rotation (``rope_parameters``' ``llama_4_scaling_beta``).
"""

from __future__ import annotations

import torch

from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE
from engine.models.rotary import RotaryEmbedding, rope_parameters
from engine.models.routers import Router


def make_moe(config, backend: str) -> FusedMoE:
    """Routed experts under Mistral 4's grouped softmax routing, beside the shared experts."""
    hidden, top_k, experts = config.hidden_size, config.num_experts_per_tok, config.n_routed_experts
    gate = Router(
        hidden, experts, top_k, scoring="grouped_topk_softmax",
        renormalize=config.norm_topk_prob, n_group=config.n_group, topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
    )  # fmt: skip
    inter = config.moe_intermediate_size
    shared = GatedMLP(hidden, inter * config.n_shared_experts, backend)
    return FusedMoE(experts, top_k, hidden, inter, gate, shared_expert=shared, backend=backend)


class Llama4ScaledRotary:
    """A rotary embedding whose step tensors carry each token's query scale as a third element
    (``LatentAttention`` multiplies the rotated query by it)."""

    def __init__(self, rotary: RotaryEmbedding, beta: float, original_max_position: int) -> None:
        self.rotary, self.beta, self.original = rotary, beta, original_max_position
        self.length_dependent = rotary.length_dependent

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, rope_lengths=None):
        """``(cos, signed_sin, query_scale)``; the scale in ``dtype``, as transformers rounds it."""
        cos, sin = self.rotary.cos_sin(positions, dtype, rope_lengths)
        scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original))
        return cos, sin, scale.to(dtype)

    def to_device(self, device: torch.device) -> None:
        """Move the rotary's caches to ``device``."""
        self.rotary.to_device(device)


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral 4: latent attention with Llama 4's query scaling, grouped-softmax experts."""

    make_moe = staticmethod(make_moe)

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        params = rope_parameters(config)
        beta = params.get("llama_4_scaling_beta")
        if beta is not None:
            self.rotaries["default"] = Llama4ScaledRotary(
                self.rotaries["default"], beta, params["original_max_position_embeddings"]
            )

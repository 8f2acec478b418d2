"""DeepSeek-V2 / V2-Lite / V2.5 (``deepseek_v2``): DeepSeek-V3's block (``deepseek_v3.py``) with
softmax routing: the ``top_k`` best experts of all (``topk_method="greedy"``) or of the
``topk_group`` groups whose best expert scores highest (``"group_limited_greedy"``), weights
never renormalised, times ``routed_scaling_factor``; the router's weight kept fp32 as
transformers keeps it. Its complex rotary pairs features as DeepSeek-V3's interleaved rope does.
"""

from __future__ import annotations

from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE
from engine.models.routers import Router

TOPK_METHODS = ("greedy", "group_limited_greedy")


def make_moe(config, backend: str) -> FusedMoE:
    """Routed experts under DeepSeek-V2's softmax routing, beside the shared experts."""
    method = config.topk_method
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method={method!r} is not supported: must be one of {TOPK_METHODS}")
    grouped = method == "group_limited_greedy"
    hidden, top_k, experts = config.hidden_size, config.num_experts_per_tok, config.n_routed_experts
    gate = Router(
        hidden, experts, top_k, scoring="grouped_topk_softmax", renormalize=False,
        n_group=config.n_group if grouped else 1, topk_group=config.topk_group if grouped else 1,
        routed_scaling_factor=config.routed_scaling_factor, fp32_weights=True, group_score="max",
    )  # fmt: skip
    inter = config.moe_intermediate_size
    shared = GatedMLP(hidden, inter * config.n_shared_experts, backend, bias=config.mlp_bias)
    return FusedMoE(experts, top_k, hidden, inter, gate, shared_expert=shared, backend=backend)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: latent attention, dense first layers, softmax-routed and shared experts."""

    make_moe = staticmethod(make_moe)

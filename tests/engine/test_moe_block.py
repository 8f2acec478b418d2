"""The FusedMoE block equals transformers' own MoE modules given the same weights, for each
router kind (Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5 with its shared expert, DeepSeek-V3), fp32,
on the torch reference and on the C++ kernel."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, from_interleaved_layout
from engine.models.routers import Router
from kernels.cpu_moe import fused_moe_available

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 64, 48, 8, 3, 21


def _hf_block(kind: str):
    common = dict(hidden_size=HIDDEN, num_attention_heads=4, num_hidden_layers=1)
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = transformers.Qwen3MoeConfig(
            **common, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
            moe_intermediate_size=INTER, norm_topk_prob=False,
        )  # fmt: skip
        return Qwen3MoeSparseMoeBlock(config), config
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = transformers.MixtralConfig(
            **common, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
            intermediate_size=INTER,
        )  # fmt: skip
        return MixtralSparseMoeBlock(config), config
    if kind == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        config = transformers.GptOssConfig(
            **common, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
            intermediate_size=INTER,
        )  # fmt: skip
        return GptOssMLP(config), config
    if kind == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

        config = transformers.Glm4MoeConfig(
            **common, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
            moe_intermediate_size=INTER, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True,
        )  # fmt: skip
        return Glm4MoeMoE(config), config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(
        **common, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER, n_group=2, topk_group=1, n_shared_experts=2,
        routed_scaling_factor=1.5, norm_topk_prob=True,
    )  # fmt: skip
    return DeepseekV3MoE(config), config


def _our_block(kind: str, config, hf, backend: str) -> FusedMoE:
    """Our block with ``hf``'s weights, built as the family files build it."""
    state = hf.state_dict()
    shared = None
    if kind == "gpt_oss":
        gate = Router(HIDDEN, EXPERTS, TOP_K, scoring="topk_softmax", bias=True, round_weights=True)
    elif kind in ("glm4_moe", "deepseek_v3"):
        gate = Router(
            HIDDEN, EXPERTS, TOP_K, scoring="grouped_topk_sigmoid",
            renormalize=config.norm_topk_prob, n_group=config.n_group,
            topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
        )  # fmt: skip
        shared = GatedMLP(HIDDEN, INTER * config.n_shared_experts, backend)
        with torch.no_grad():
            shared.gate_up_proj.weight.copy_(
                torch.cat([state["shared_experts.gate_proj.weight"],
                           state["shared_experts.up_proj.weight"]])
            )  # fmt: skip
            shared.down_proj.weight.copy_(state["shared_experts.down_proj.weight"])
    else:
        gate = Router(HIDDEN, EXPERTS, TOP_K, renormalize=kind == "mixtral")
    block = FusedMoE(
        EXPERTS, TOP_K, HIDDEN, INTER, gate,
        activation="swigluoai" if kind == "gpt_oss" else "silu",
        has_bias=kind == "gpt_oss", shared_expert=shared, backend=backend,
    )  # fmt: skip
    prefix = "router" if kind == "gpt_oss" else "gate"
    with torch.no_grad():
        for name, value in state.items():
            value = from_interleaved_layout(name, value) if kind == "gpt_oss" else value
            if name.startswith(prefix + "."):
                getattr(block.gate, name.split(".", 1)[1]).copy_(value)
            elif name.startswith("experts."):
                stem = "w13" if "gate_up" in name else "w2"
                getattr(block, f"{stem}_{'bias' if name.endswith('bias') else 'weight'}").copy_(
                    value
                )
    return block


KINDS = ["qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3"]


@pytest.mark.parametrize("kind", KINDS)
def test_block_matches_transformers(kind):
    torch.manual_seed(KINDS.index(kind))
    hf, config = _hf_block(kind)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.1 if "bias" not in name else 0.3)
        if hasattr(hf.gate if kind != "gpt_oss" else hf.router, "e_score_correction_bias"):
            hf.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(1, TOKENS, HIDDEN)
    with torch.inference_mode():
        expected = hf(x)
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
        backends = ["torch"] + (["cpu"] if fused_moe_available(torch.float32) else [])
        for backend in backends:
            block = _our_block(kind, config, hf, backend)
            assert block.prepack() == (backend == "cpu")
            got = block(x[0])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=backend)

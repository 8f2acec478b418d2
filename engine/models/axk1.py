"""A.X-K1 (``axk1``, SK Telecom): DeepSeek-V3's block (``deepseek_v3.py``) with dense and sparse
layers named by ``mlp_layer_types`` and an RMSNorm over each MoE block's output (routed plus
shared experts). Released checkpoints keep that norm at the layer level
(``layers.N.post_mlp_layernorm``, dense layers too, where transformers ignores it) and may lack
the routers' correction bias (zeros then, as transformers leaves it)."""

from __future__ import annotations

import re

from engine.models.deepseek_v3 import DeepseekV3ForCausalLM, is_sparse
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.moe import FusedMoE
from engine.models.norm import RMSNorm

_POST_NORM = re.compile(r"^layers\.(\d+)\.post_mlp_layernorm\.")


def make_moe(config, backend: str) -> FusedMoE:
    """DeepSeek-V3's routed and shared experts, their sum normed."""
    moe = Glm4MoeForCausalLM.make_moe(config, backend)
    moe.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
    moe.gate.e_score_correction_bias.expected_shards = set()  # loaded where the checkpoint has it
    return moe


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """A.X-K1: latent attention, experts whose output is RMS-normed."""

    make_moe = staticmethod(make_moe)

    def checkpoint_name(self, name: str) -> str | None:
        match = _POST_NORM.match(name)
        if match:
            if not is_sparse(self.config, int(match.group(1))):
                return None  # a dense layer's norm, unused (transformers ignores it too)
            name = name.replace(".post_mlp_layernorm.", ".mlp.post_mlp_layernorm.", 1)
        return super().checkpoint_name(name)

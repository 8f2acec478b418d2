"""DeepSeek-V3 / R1 (``deepseek_v3``; Kimi K2 ships the same architecture): multi-head latent
attention (``latent_attention.py``) with a paged cache of one latent row per token; dense
SwiGLU in the first ``first_k_dense_replace`` layers, then routed experts chosen by grouped
sigmoid scores with a correction bias beside a shared expert (the block GLM-4.5 took over,
``Glm4MoeForCausalLM.make_moe``)."""

from __future__ import annotations

import re

from engine.kv_cache_spec import LatentAttentionSpec
from engine.models.causal_lm import PACKED_MODULES
from engine.models.decoder import DecoderLayer
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.latent_attention import LatentAttention
from engine.models.mlp import GatedMLP
from engine.models.moe import MoECausalLM
from engine.models.rotary import RotaryEmbedding

_LAYER = re.compile(r"^layers\.(\d+)\.")
_MLP_PARTS = {k: v for k, v in PACKED_MODULES.items() if k in ("gate_proj", "up_proj")}
# The q LoRA's down projection and kv_a_proj_with_mqa read the same input: one GEMM.
_QKV_A_PARTS = {"q_a_proj": ("qkv_a_proj", "q_a"), "kv_a_proj_with_mqa": ("qkv_a_proj", "kv_a")}


class DeepseekV3ForCausalLM(MoECausalLM):
    """DeepSeek-V3's block: latent attention, dense first layers, then routed and shared
    experts."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        self.packed_modules = dict(_MLP_PARTS)
        if config.q_lora_rank is not None:
            self.packed_modules.update(_QKV_A_PARTS)
        self.rotaries["default"] = RotaryEmbedding(config, config.qk_rope_head_dim, max_position)
        hidden = config.hidden_size
        for i in range(config.num_hidden_layers):
            if i >= config.first_k_dense_replace:
                mlp = Glm4MoeForCausalLM.make_moe(config, backend)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size, backend)
            attn = LatentAttention(config, backend)
            layer = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

    def kv_cache_specs(self) -> list[LatentAttentionSpec]:
        """One latent row per token in every layer."""
        return [layer.self_attn.kv_cache_spec() for layer in self.layers]

    def checkpoint_name(self, name: str) -> str | None:
        # Layers past num_hidden_layers are the multi-token-prediction modules (DeepSeek-V3's
        # layer 61), which transformers does not run either.
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None
        return super().checkpoint_name(name)

"""DeepSeek-V3 / R1 (``deepseek_v3``; Kimi K2 ships the same architecture) and the families
built on its block: multi-head latent attention (``latent_attention.py``) with a paged cache of
one latent row per token; dense SwiGLU in the first ``first_k_dense_replace`` layers (or where
``mlp_layer_types`` says ``"dense"``), then routed experts chosen by grouped sigmoid scores with
a correction bias beside a shared expert (the block GLM-4.5 took over,
``Glm4MoeForCausalLM.make_moe``).

``glm4_moe_lite`` (GLM-4.7-Flash) is this block with ``mlp_layer_types``; ``youtu`` (Youtu-LLM)
is its latent attention with dense MLPs only. DeepSeek-V2, Mistral 4 and MiniCPM3 change one
part each (``deepseek_v2.py``, ``mistral4.py``, ``minicpm3.py``).
"""

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


def is_sparse(config, layer_idx: int) -> bool:
    """True where layer ``layer_idx`` holds routed experts: ``mlp_layer_types`` where the config
    has them (GLM-4.7-Flash, Kimi Linear), else every layer from ``first_k_dense_replace`` on;
    a config with neither (Youtu-LLM) is dense."""
    types = getattr(config, "mlp_layer_types", None)
    if types:
        return types[layer_idx] == "sparse"
    first_dense = getattr(config, "first_k_dense_replace", None)
    return first_dense is not None and layer_idx >= first_dense


class DeepseekV3ForCausalLM(MoECausalLM):
    """DeepSeek-V3's block: latent attention, dense first layers, then routed and shared
    experts. Subclasses change ``make_moe`` (the routing), ``make_attention``,
    ``rope_interleave`` or ``residual_multiplier``, or wrap ``self.rotaries["default"]``."""

    rope_interleave: bool | None = None  # None: the config's, True where it has none
    make_moe = staticmethod(Glm4MoeForCausalLM.make_moe)

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        self.packed_modules = dict(_MLP_PARTS)
        if config.q_lora_rank is not None:
            self.packed_modules.update(_QKV_A_PARTS)
        rope_dim = config.qk_rope_head_dim
        self.rotaries["default"] = RotaryEmbedding(config, rope_dim, max_position, rope_dim)
        hidden = config.hidden_size
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        for i in range(config.num_hidden_layers):
            if is_sparse(config, i):
                mlp = self.make_moe(config, backend)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size, backend, bias=mlp_bias)
            attn = self.make_attention(config, backend)
            layer = DecoderLayer(
                attn, mlp, hidden, config.rms_norm_eps, backend,
                residual_multiplier=self.residual_multiplier(config),
            )  # fmt: skip
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

    def make_attention(self, config, backend: str) -> LatentAttention:
        """A layer's latent attention (DeepSeek-V3.2 adds its indexer)."""
        return LatentAttention(config, backend, self.rope_interleave)

    @staticmethod
    def residual_multiplier(config) -> float | None:
        """What each block's output is scaled by before the residual sum (None: 1)."""
        return None

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

"""Ling 3 hybrids (``bailing_hybrid``, inclusionAI's Bailing MoE V3): Kimi Delta Attention
layers beside latent-attention layers (every ``layer_group_size``-th, per ``layer_types``), a
dense SwiGLU in the first layers, then DeepSeek-V3's routed and shared experts.

Against Kimi Linear (``kimi_linear.py``) the parts that differ:

- KDA: full-rank forget and output gates (``f_proj``, ``g_proj``: one GEMM here), ``A_log`` of
  ``[heads]``; with ``kda_safe_gate`` (the default) the log decay is bounded,
  ``kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``, else Kimi's
  ``-exp(A_log) * softplus(f + dt_bias)``.
- MLA: rotated (interleaved pairs, yarn's mscale in the softmax scale) as DeepSeek-V3's, and its
  output gated per head by ``sigmoid(g_proj(x))`` before ``o_proj``.
- Routed experts as DeepSeek-V3's (grouped sigmoid scores with a correction bias), counted by
  ``num_local_experts``; layers past ``num_hidden_layers`` (multi-token prediction) not read.

Released checkpoints (``attention.``, ``dense``, ``word_embeddings``, ``expert_bias``, a conv per
q, k and v) and transformers 5's own layout load alike.

Past one rank both mixers split by heads (the gates' rows with them) and the experts as
DeepSeek-V3's do.
"""

from __future__ import annotations

import re

import torch

from engine.models.decoder import DecoderLayer
from engine.models.deepseek_v3 import is_sparse
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.hybrid import HybridLayers
from engine.models.kimi_linear import LINEAR, KimiDeltaAttention
from engine.models.latent_attention import LatentAttention
from engine.models.mlp import GatedMLP
from engine.models.moe import MoECausalLM
from engine.models.rotary import RotaryEmbedding
from engine.parallel.layers import ColumnParallelLinear, MergedColumnParallelLinear

_LAYER = re.compile(r"^layers\.(\d+)\.")
# Released checkpoints' names -> transformers' (its conversion mapping for the family).
_RELEASED_NAMES = [
    (re.compile(r"^word_embeddings\."), "embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
]
# A KDA layer's names -> ours: the q/k/v/b projections into ``in_proj`` and the two gates into
# ``fg_proj`` (shards of one GEMM each), the per-channel convs into shards of ``conv1d``.
_KDA_NAMES = [
    (re.compile(r"\.self_attn\.([qkvb])_proj\."), r".self_attn.in_proj_\1."),
    (re.compile(r"\.self_attn\.(forget_gate\.)?f_proj\."), ".self_attn.fg_proj_f."),
    (re.compile(r"\.self_attn\.g_proj\."), ".self_attn.fg_proj_g."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.self_attn\.([qkv])_conv1d\."), r".self_attn.conv1d_\1."),
]


class BailingDeltaAttention(KimiDeltaAttention):
    """Kimi Delta Attention with full-rank gates and, by default, a bounded decay."""

    def __init__(self, config, backend: str) -> None:
        super().__init__(config, backend)
        del self.fg_a_proj, self.f_b_proj, self.g_b_proj
        full = config.linear_num_heads * config.linear_head_dim
        self.fg_proj = MergedColumnParallelLinear(config.hidden_size, {"f": full, "g": full})
        self.A_log.checkpoint_shape = lambda shard: (config.linear_num_heads,)
        self.safe_gate = bool(config.kda_safe_gate)
        self.lower_bound = float(config.kda_lower_bound)

    def gate_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fg_proj(hidden).split(self.qkv_dim, dim=1)

    def decay(self, forget: torch.Tensor) -> torch.Tensor:
        if not self.safe_gate:
            return super().decay(forget)
        x = (forget.float() + self.dt_bias.float()).view(-1, self.num_heads, self.head_dim)
        return self.lower_bound * torch.sigmoid(self.A_log.float().exp()[:, None] * x)


class HeadGatedLatentAttention(LatentAttention):
    """Latent attention whose output is scaled per head by ``sigmoid(g_proj(x))``."""

    def __init__(self, config, backend: str = "auto") -> None:
        super().__init__(config, backend)
        self.g_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads)

    def gate_output(self, out: torch.Tensor, gate, hidden: torch.Tensor) -> torch.Tensor:
        # transformers rounds the sigmoid to the model's dtype before the product.
        per_head = torch.sigmoid(self.g_proj(hidden).float()).to(out.dtype)
        heads = out.view(out.shape[0], self.num_heads, self.v_head_dim) * per_head[..., None]
        return heads.view(out.shape)


class BailingHybridForCausalLM(HybridLayers, MoECausalLM):
    """Ling 3's stack: KDA and gated latent-attention layers, dense first MLPs, then experts."""

    packed_modules = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "q_a_proj": ("qkv_a_proj", "q_a"),
        "kv_a_proj_with_mqa": ("qkv_a_proj", "kv_a"),
        **{f"in_proj_{p}": ("in_proj", p) for p in "qkvb"},
        **{f"fg_proj_{p}": ("fg_proj", p) for p in "fg"},
        **{f"conv1d_{p}": ("conv1d", p) for p in "qkv"},
    }

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        if config.q_lora_rank is None:
            self.packed_modules = {
                k: v for k, v in self.packed_modules.items() if v[0] != "qkv_a_proj"
            }
        hidden, eps, rope_dim = config.hidden_size, config.rms_norm_eps, config.qk_rope_head_dim
        self.rotaries["default"] = RotaryEmbedding(config, rope_dim, max_position, rope_dim)
        self.layer_types = list(config.layer_types)
        for i, layer_type in enumerate(self.layer_types):
            if layer_type == LINEAR:
                mixer = BailingDeltaAttention(config, backend)
            else:
                mixer = HeadGatedLatentAttention(config, backend)
            if is_sparse(config, i):
                mlp = Glm4MoeForCausalLM.make_moe(config, backend, config.num_local_experts)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size, backend)
            layer = DecoderLayer(mixer, mlp, hidden, eps, backend)
            layer.rope_key = None if layer_type == LINEAR else "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

    def checkpoint_name(self, name: str) -> str | None:
        for pattern, repl in _RELEASED_NAMES:
            name = pattern.sub(repl, name)
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1))
            if index >= len(self.layer_types):  # the multi-token-prediction layers
                return None
            if self.layer_types[index] == LINEAR:
                for pattern, repl in _KDA_NAMES:
                    name = pattern.sub(repl, name)
        return super().checkpoint_name(name)

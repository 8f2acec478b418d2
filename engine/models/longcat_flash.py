"""LongCat-Flash (``longcat_flash``, Meituan, 560B): each of ``num_layers`` blocks holds two
latent-attention sublayers (DeepSeek-V3's, with the LoRA scales ``sqrt(hidden / q_lora_rank)`` on
the query and ``sqrt(hidden / kv_lora_rank)`` on the normed latent), each followed by a dense
SwiGLU MLP, and a shortcut-connected MoE: the experts read the first sublayer's normed
attention output and their sum joins the block's output. The router's softmax covers
``zero_expert_num`` zero-computation experts too, which return their input scaled by their
weight; experts are chosen by the scores plus a correction bias, weighted by the scores (not
renormalised) times ``routed_scaling_factor``."""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.kv_cache_spec import LatentAttentionSpec
from engine.models.deepseek_v3 import _MLP_PARTS, _QKV_A_PARTS
from engine.models.latent_attention import LatentAttention
from engine.models.linear import KeepsPackedDtypes, linear_fp32_out
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding
from engine.parallel.state import all_reduce

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class LongcatRouter(KeepsPackedDtypes):
    """Softmax over routed and zero-computation experts (fp32 ``classifier``), top k by score
    plus ``e_score_correction_bias``; ``(weights fp32, ids)``."""

    def __init__(self, config) -> None:
        super().__init__()
        experts = config.n_routed_experts + (config.zero_expert_num or 0)
        self.top_k, self.scaling = config.moe_topk, config.routed_scaling_factor
        self.classifier = nn.Linear(
            config.hidden_size, experts, bias=bool(getattr(config, "router_bias", False))
        )
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        for param in self.parameters():
            param.keep_dtype = True  # fp32 in a bf16 model, as transformers computes it

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear_fp32_out(x, self.classifier.weight, self.classifier.bias)
        scores = logits.softmax(dim=-1)
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1)[1]
        return scores.gather(1, ids) * self.scaling, ids


class LongcatMoE(FusedMoE):
    """Routed experts beside zero-computation ones (ids past ``n_routed_experts``)."""

    def __init__(self, config, backend: str) -> None:
        super().__init__(
            config.n_routed_experts, config.moe_topk, config.hidden_size,
            config.expert_ffn_hidden_size, gate=LongcatRouter(config), backend=backend,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        zero = ids >= self.num_experts
        # A zero-computation expert's slot runs expert 0 with weight 0; its weight scales x.
        routed_weights, routed_ids = weights.masked_fill(zero, 0.0), ids.masked_fill(zero, 0)
        if self.parallel is None:
            routed = self.experts(x, routed_weights, routed_ids)
        else:
            routed = all_reduce(self._rank_share(x, routed_weights, routed_ids))
        identity = (weights * zero).sum(dim=-1, keepdim=True)
        return (routed.float() + x.float() * identity).to(x.dtype)


class LongcatFlashDecoderLayer(nn.Module):
    """Two attention-and-MLP sublayers and the shortcut MoE, the residual stream in fp32."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = nn.ModuleList(LatentAttention(config, backend) for _ in range(2))
        for attn in self.self_attn:
            attn.q_scale = (hidden / config.q_lora_rank) ** 0.5
            attn.latent_scale = (hidden / config.kv_lora_rank) ** 0.5
        self.mlps = nn.ModuleList(
            GatedMLP(hidden, config.ffn_hidden_size, backend) for _ in range(2)
        )
        self.input_layernorm = nn.ModuleList(RMSNorm(hidden, eps, backend) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(
            RMSNorm(hidden, eps, backend) for _ in range(2)
        )
        self.mlp = LongcatMoE(config, backend)

    def forward(self, rope, hidden, residual, kv_caches, metas):
        """``(block output, residual stream)``, as ``DecoderLayer``'s "pre" style."""
        shortcut = None
        for i in range(2):
            if residual is None:
                residual, hidden = hidden.float(), self.input_layernorm[i](hidden)
            else:
                hidden, residual = self.input_layernorm[i](hidden, residual)
            hidden = self.self_attn[i](rope, hidden, kv_caches[i], metas[i])
            hidden, residual = self.post_attention_layernorm[i](hidden, residual)
            if shortcut is None:
                shortcut = self.mlp(hidden)
            hidden = self.mlps[i](hidden)
        return hidden + shortcut, residual


class LongcatFlashForCausalLM(MoECausalLM):
    """LongCat-Flash: a latent cache per attention sublayer, two per block."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        self.packed_modules = {**_MLP_PARTS, **_QKV_A_PARTS}
        rope_dim = config.qk_rope_head_dim
        self.rotaries["default"] = RotaryEmbedding(config, rope_dim, max_position, rope_dim)
        for _ in range(config.num_layers):
            layer = LongcatFlashDecoderLayer(config, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        pairs = [kv_caches[i : i + 2] for i in range(0, len(kv_caches), 2)]
        return super().forward(
            input_ids, positions, pairs, [meta[i : i + 2] for i in range(0, len(meta), 2)]
        )

    def rope_lengths(self, positions: torch.Tensor, meta) -> torch.Tensor | None:
        return super().rope_lengths(positions, meta[0])

    def kv_cache_specs(self) -> list[LatentAttentionSpec]:
        """A latent row per token in each attention sublayer."""
        return [attn.kv_cache_spec() for layer in self.layers for attn in layer.self_attn]

    def kv_cache_indices(self) -> list[int]:
        return list(range(2 * len(self.layers)))

    def checkpoint_name(self, name: str) -> str | None:
        # The zero-computation experts have no weights, though transformers' fused gate_up
        # tensor (and its per-expert export) has rows for them.
        match = _EXPERT.search(name)
        if match and int(match.group(1)) >= self.config.n_routed_experts:
            return None
        return super().checkpoint_name(name)

    def load_weights(self, weights) -> None:
        routed = self.config.n_routed_experts
        super().load_weights(
            (name, t[:routed] if name.endswith("experts.gate_up_proj") else t)
            for name, t in weights
        )

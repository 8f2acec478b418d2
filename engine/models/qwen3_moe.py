"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): Qwen3's attention (per-head
QK-norm) and a mixture of experts in every ``decoder_sparse_step``-th layer outside
``mlp_only_layers`` (softmax over the experts, the top k, renormalised with
``norm_topk_prob``), dense SwiGLU elsewhere. Qwen2-MoE (``qwen2_moe.py``) differs only in its
attention and a gated shared expert."""

from __future__ import annotations

from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import head_dim_of, layer_sliding_window, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router


def is_sparse_layer(config, i: int) -> bool:
    """True where layer ``i`` of a Qwen2/3-MoE config holds the experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return i not in only_mlp and config.num_experts > 0 and (i + 1) % step == 0


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3's block with routed experts."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        hidden = config.hidden_size
        for i in range(config.num_hidden_layers):
            attn = Attention(
                hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim, backend,
                self.attention_options(config, i, max_position),
            )  # fmt: skip
            if is_sparse_layer(config, i):
                mlp = self.make_moe(config, backend)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size, backend)
            layer = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

    @staticmethod
    def attention_options(config, i: int, max_position: int) -> AttentionOptions:
        """Qwen3's: per-head QK-norm, q/k/v biases where ``attention_bias``."""
        return AttentionOptions(
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm="head",
            norm_eps=config.rms_norm_eps,
            sliding_window=layer_sliding_window(config, i, max_position),
        )

    @staticmethod
    def make_moe(config, backend: str, shared_expert: nn.Module | None = None) -> FusedMoE:
        """The routed experts (weights rounded to the model's dtype, as Qwen rounds them)."""
        hidden, experts, top_k = config.hidden_size, config.num_experts, config.num_experts_per_tok
        gate = Router(hidden, experts, top_k, renormalize=config.norm_topk_prob, round_weights=True)
        return FusedMoE(
            experts, top_k, hidden, config.moe_intermediate_size, gate, backend=backend,
            shared_expert=shared_expert, shared_expert_gate=shared_expert is not None,
        )  # fmt: skip

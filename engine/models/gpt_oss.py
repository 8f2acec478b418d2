"""gpt-oss (20b, 120b): attention with q/k/v/o biases and a learned sink per head, sliding and
full layers alternating (``layer_types``), yarn rotary; experts with biases and a clamped
SwiGLU (gate and up in alternating columns of the checkpoint), routed by the softmax of the
top-k logits of a router with a bias. MXFP4 checkpoints are not read yet."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import head_dim_of, layer_sliding_window, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.moe import FusedMoE, MoECausalLM, from_interleaved_layout
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router


class GptOssForCausalLM(MoECausalLM):
    """gpt-oss's block: sink attention and biased experts."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        hidden, experts, top_k = (
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
        )
        for i in range(config.num_hidden_layers):
            bias = bool(getattr(config, "attention_bias", True))
            options = AttentionOptions(
                qkv_bias=bias,
                o_bias=bias,
                sinks=True,
                sliding_window=layer_sliding_window(config, i, max_position),
            )
            attn = Attention(
                hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim, backend,
                options,
            )  # fmt: skip
            gate = Router(
                hidden, experts, top_k, scoring="topk_softmax", bias=True, round_weights=True
            )
            mlp = FusedMoE(
                experts, top_k, hidden, config.intermediate_size, gate,
                activation="swigluoai", has_bias=True,
                swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
                swiglu_limit=getattr(config, "swiglu_limit", 7.0), backend=backend,
            )  # fmt: skip
            layer = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, backend)
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """gpt-oss's expert tensors are transposed and interleaved: put them in our layout."""
        super().load_weights((name, from_interleaved_layout(name, t)) for name, t in weights)

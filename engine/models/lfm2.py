"""Liquid AI's LFM2 (``lfm2``) and LFM2-MoE (``lfm2_moe``): pre-norm blocks whose token mixer
is, per ``config.layer_types``, a gated short convolution (``"conv"``) or full attention with
per-head QK-norm.

The short convolution: ``in_proj`` gives ``B, C, x`` (``hidden`` channels each); a depthwise
causal conv of width ``conv_L_cache`` over ``B * x``, no activation; ``C * conv`` then
``out_proj``. It keeps no KV: the last ``conv_L_cache - 1`` inputs of each channel live in a
state slot per sequence (engine/state_cache.py) and run through kernels/causal_conv1d.py, as
Qwen3.5's Gated DeltaNet conv does; there is no recurrent state beyond it.

Past one rank the channels split: each rank holds ``1 / N`` of the channels of ``B``, ``C`` and
``x`` (their rows of ``in_proj``), of the conv and of its state, and ``out_proj`` is
row-parallel (the one all-reduce).

LFM2-MoE keeps the layers and routes experts past its first ``num_dense_layers``: sigmoid scores,
the top k by the scores plus ``expert_bias``, renormalised (``+ 1e-6``), times
``routed_scaling_factor`` (DeepSeek-V3's routing with one group).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import PACKED_MODULES
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.hybrid import HybridLayers
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router
from engine.parallel.layers import MergedColumnParallelLinear, RowParallelLinear
from engine.parallel.state import divide, tp_rank, tp_size
from engine.state_cache import RecurrentStateSpec
from kernels.causal_conv1d import causal_conv1d

CONV = "conv"

# Checkpoint names -> ours, each replaced once: ``.conv.`` is the mixer, not its conv.
_RENAMES = (
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".feed_forward.", ".mlp."),
    (".conv.", ".self_attn."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)


def _split_channels(param: nn.Parameter, channels: int) -> None:
    """``param`` (this rank's rows) loads its ``1 / N`` of the checkpoint's ``channels`` rows."""

    def load(p: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        p.data.copy_(tensor.narrow(0, tp_rank() * p.shape[0], p.shape[0]))

    param.weight_loader = load
    param.checkpoint_shape = lambda shard: (channels, *param.shape[1:])


class ShortConv(nn.Module):
    """LFM2's gated short convolution over a flat varlen batch; its conv state is the slot
    ``meta.state_indices`` of the pool bound by ``bind_state``."""

    sliding_window = None

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.conv_bias)
        self.channels = divide(hidden, tp_size(), "hidden_size")  # this rank's
        self.kernel_size = config.conv_L_cache
        self.in_proj = MergedColumnParallelLinear(
            hidden, {"B": hidden, "C": hidden, "x": hidden}, bias=bias
        )
        self.conv = nn.Conv1d(
            self.channels, self.channels, self.kernel_size, groups=self.channels, bias=bias
        )
        for param in self.conv.parameters():
            _split_channels(param, hidden)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        self.backend = backend
        self.conv_state: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        """The conv window per sequence; no recurrent state (an empty one)."""
        return RecurrentStateSpec((self.channels, self.kernel_size - 1), (0, 0, 0))

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Use the pool ``[num_slots, channels, kernel_size - 1]`` for the conv state."""
        self.conv_state = conv_state

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        conv = causal_conv1d(
            (b * x).contiguous(), self.conv.weight.squeeze(1), self.conv.bias, self.conv_state,
            meta.query_start_loc, meta.state_indices, meta.has_initial_state, None,
            backend=self.backend,
        )  # fmt: skip
        return self.out_proj(c * conv)


def intermediate_size_of(config) -> int:
    """The MLP width as ``Lfm2MLP`` adjusts it (2/3, the multiplier, rounded up)."""
    size = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2ForCausalLM(HybridLayers, MoECausalLM):
    """LFM2's hybrid stack: short-conv and attention layers, SwiGLU MLPs (``make_mlp``: the
    MoE variant's experts), a final norm."""

    packed_modules = {
        **PACKED_MODULES,
        "w1": ("gate_up_proj", "gate"),
        "w3": ("gate_up_proj", "up"),
    }

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, eps = config.hidden_size, config.norm_eps
        self.make_rotaries(config, max_position)
        self.layer_types = list(config.layer_types)
        for i, layer_type in enumerate(self.layer_types):
            if layer_type == CONV:
                mixer = ShortConv(config, backend)
            else:
                mixer = Attention(
                    hidden, config.num_attention_heads, num_kv_heads_of(config),
                    head_dim_of(config), backend, self.attention_options(config, i),
                )  # fmt: skip
            layer = DecoderLayer(
                mixer, self.make_mlp(config, i), hidden, eps, backend, self.norm_style(config)
            )
            layer.rope_key = self.rope_key(i)
            self.layers.append(layer)
        self.norm = RMSNorm(hidden, eps, backend)

    @staticmethod
    def norm_style(config) -> str:
        """Each block's norms (``DecoderLayer``'s styles): before the mixer and the MLP."""
        return "pre"

    def make_rotaries(self, config, max_position: int) -> None:
        """``self.rotaries``: one RoPE for every attention layer."""
        self.rotaries["default"] = RotaryEmbedding(config, head_dim_of(config), max_position)

    def rope_key(self, i: int) -> str:
        """Which of ``self.rotaries`` layer ``i`` uses."""
        return "default"

    def attention_options(self, config, i: int) -> AttentionOptions:
        """Layer ``i``'s attention: per-head QK-norm."""
        return AttentionOptions(qk_norm="head", norm_eps=config.norm_eps)

    def make_mlp(self, config, i: int) -> nn.Module:
        """Layer ``i``'s feed-forward block."""
        return GatedMLP(config.hidden_size, intermediate_size_of(config), self.backend)

    def checkpoint_name(self, name: str) -> str | None:
        """transformers' LFM2 names -> ours (``conv`` / ``self_attn`` are both ``self_attn``)."""
        if name == "embedding_norm.weight":  # LFM2's final norm, despite its name
            return "norm.weight"
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours, 1)
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if layer is not None and self.layer_types[int(layer)] != CONV:
            name = name.replace(".self_attn.out_proj.", ".self_attn.o_proj.")
        return super().checkpoint_name(name)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: dense first ``num_dense_layers``, routed experts after them."""

    def make_mlp(self, config, i: int) -> nn.Module:
        if i < config.num_dense_layers:
            return GatedMLP(config.hidden_size, config.intermediate_size, self.backend)
        experts, top_k = config.num_experts, config.num_experts_per_tok
        gate = Router(
            config.hidden_size, experts, top_k, scoring="grouped_topk_sigmoid",
            renormalize=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor,
            renormalize_eps=1e-6,
        )  # fmt: skip
        if not config.use_expert_bias:  # no bias in the checkpoint: scores choose alone
            del gate.e_score_correction_bias
            gate.register_buffer("e_score_correction_bias", torch.zeros(experts), persistent=False)
        return FusedMoE(
            experts, top_k, config.hidden_size, config.moe_intermediate_size, gate,
            backend=self.backend,
        )  # fmt: skip

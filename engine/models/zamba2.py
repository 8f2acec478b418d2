"""Zyphra's Zamba2 (``zamba2``): a stack of Mamba-2 layers (engine/models/mamba2.py), some of
which (``layers_block_type == "hybrid"``) first run a shared transformer block.

A hybrid layer's shared block reads ``[hidden | embeddings]`` (twice the hidden size, the token
embeddings kept from the start), normed; attention with ``head_dim = 2 hidden / heads``, scale
``(head_dim / 2) ** -0.5`` and RoPE with ``use_mem_rope``; its output normed and through a GELU
MLP; then the layer's own ``linear``. The Mamba-2 layer takes ``norm(hidden + that)`` and adds its
output to ``hidden``. ``num_mem_blocks`` blocks take turns over the hybrid layers (use ``j`` runs
block ``j % num_mem_blocks``), their weights shared: each use is its own ``Zamba2Attention``
(its own paged KV) on the block's projections, with low-rank adapters of its own on q, k, v
and the MLP's gate/up projection (``use_shared_attention_adapter``). Checkpoints hold a block's
weights, and every use's adapters, under the block's first hybrid layer. As in transformers 5,
the uses share a block only where the config ties weights (``tie_word_embeddings``, the
released checkpoints' setting); untied, each hybrid layer runs a block of its own.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.hybrid import HybridLayers
from engine.models.mamba2 import Mamba2Mixer
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding
from engine.parallel.layers import RowParallelLinear

# The shared block's modules, tied across its uses.
_SHARED = ("input_layernorm", "pre_ff_layernorm", "self_attn.qkv_proj", "self_attn.o_proj",
           "feed_forward.gate_up_proj", "feed_forward.down_proj")  # fmt: skip
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_ADAPTER = re.compile(r"^(self_attn|feed_forward)\.(\w+)_adapter_list\.(\d+)\.(\d)\.weight$")


def low_rank(in_size: int, rank: int, out_size: int) -> nn.Sequential:
    """Zamba2's adapter: ``B(A x)``, no bias."""
    down, up = nn.Linear(in_size, rank, bias=False), nn.Linear(rank, out_size, bias=False)
    return nn.Sequential(down, up)


class Zamba2Attention(Attention):
    """One use of a shared block's attention: ``[q | k | v]`` plus this use's adapters (``None``
    without them); ``o_proj`` back to the hidden size."""

    def __init__(self, config, backend: str) -> None:
        width, heads = config.attention_hidden_size, config.num_attention_heads
        head_dim = config.attention_head_dim
        super().__init__(
            width, heads, config.num_key_value_heads, head_dim, backend,
            AttentionOptions(scale=(head_dim / 2) ** -0.5),
        )  # fmt: skip
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=False)
        self.adapters = None
        if config.use_shared_attention_adapter:
            kv_width = config.num_key_value_heads * head_dim
            sizes = (heads * head_dim, kv_width, kv_width)
            self.adapters = nn.ModuleList(low_rank(width, config.adapter_rank, s) for s in sizes)

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.adapters is None:
            return qkv
        return qkv + torch.cat([adapter(hidden) for adapter in self.adapters], dim=1)


class Zamba2MLP(nn.Module):
    """``down(gelu(gate) * up)`` with this use's adapter on ``[gate | up]``."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(config.add_bias_linear)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.adapter = low_rank(hidden, config.adapter_rank, 2 * inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.adapter(x)).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate) * up)


class Zamba2Layer(nn.Module):
    """A Mamba-2 layer, after one use of a shared block where the layer is a hybrid one."""

    def __init__(self, config, hybrid: bool, backend: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.mamba = Mamba2Mixer(
            hidden, config.n_mamba_heads, config.mamba_headdim, config.mamba_ngroups,
            config.mamba_d_state, config.mamba_d_conv, 1e-5, backend,
            conv_bias=bool(config.use_conv_bias), proj_bias=bool(config.add_bias_linear),
            time_step_limit=(config.time_step_min, float("inf")),
        )  # fmt: skip
        self.mamba_norm = RMSNorm(hidden, eps, backend)
        self.hybrid = hybrid
        if hybrid:
            self.input_layernorm = RMSNorm(config.attention_hidden_size, eps, backend)
            self.self_attn = Zamba2Attention(config, backend)
            self.pre_ff_layernorm = RMSNorm(hidden, eps, backend)
            self.feed_forward = Zamba2MLP(config)
            self.linear = nn.Linear(hidden, hidden, bias=False)

    def share_block_of(self, first: Zamba2Layer) -> None:
        """Run ``first``'s block weights (this layer keeps its own adapters and KV)."""
        for path in _SHARED:
            owner, _, name = path.rpartition(".")
            mine = self.get_submodule(owner) if owner else self
            setattr(mine, name, first.get_submodule(path))

    def forward(self, rope, hidden, embeds, kv_cache, meta):
        x = hidden
        if self.hybrid:
            shared = self.input_layernorm(torch.cat((hidden, embeds), dim=-1))
            shared = self.self_attn(rope, shared, kv_cache, meta)
            shared = self.feed_forward(self.pre_ff_layernorm(shared))
            x = hidden + self.linear(shared)
        return hidden + self.mamba(rope, self.mamba_norm(x), None, meta)


class Zamba2ForCausalLM(HybridLayers, CausalLM):
    """Zamba2's stack: Mamba-2 layers, the hybrid ones after a shared transformer block."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        if config.hidden_act != "gelu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: must be 'gelu'")
        if not config.use_shared_attention_adapter:
            raise ValueError("use_shared_attention_adapter=False is not supported: must be True")
        if config.use_mem_rope:
            self.rotaries["default"] = RotaryEmbedding(
                config, config.attention_head_dim, max_position
            )
        # As transformers 5 does, the uses of a block share its weights only where the config
        # ties weights; untied, every hybrid layer has a block of its own.
        tied = bool(config.tie_word_embeddings)
        self.block_of: dict[int, int] = {}  # hybrid layer -> the layer whose block it runs
        firsts: list[int] = []
        for i, kind in enumerate(config.layers_block_type):
            layer = Zamba2Layer(config, kind == "hybrid", backend)
            if kind == "hybrid":
                use = len(self.block_of)
                if use < config.num_mem_blocks:
                    firsts.append(i)
                first = firsts[use % config.num_mem_blocks] if tied else i
                if first != i:
                    layer.share_block_of(self.layers[first])
                self.block_of[i] = first
            self.layers.append(layer)
        self.hybrid_layers = list(self.block_of)  # use j's layer
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def _stateful_mixers(self) -> list[nn.Module]:
        return [layer.mamba for layer in self.layers]

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        rotary = self.rotaries.get("default")
        rope = rotary.cos_sin(positions, embeds.dtype, None) if rotary is not None else None
        hidden = embeds
        for layer, kv_cache, layer_meta in zip(self.layers, *self.per_layer(kv_caches, meta)):
            hidden = layer(rope, hidden, embeds, kv_cache, layer_meta)
        return self.norm(hidden)

    def checkpoint_name(self, name: str) -> str | None:
        """Zamba2's names -> ours: a block's weights under the layer whose block it is; use ``j``'s
        adapters (``..._adapter_list.j`` of that layer's block) under use ``j``'s own layer."""
        name = name.removeprefix("model.")
        if name == "final_layernorm.weight":
            return "norm.weight"
        match = _LAYER.match(name)
        if not match:
            return super().checkpoint_name(name)
        layer, rest = int(match.group(1)), match.group(2)
        if not rest.startswith("shared_transformer."):
            rest = rest.removeprefix("mamba_decoder.")
            if rest.startswith("input_layernorm."):  # the Mamba layer's own norm
                rest = "mamba_norm." + rest.removeprefix("input_layernorm.")
            return super().checkpoint_name(f"layers.{layer}.{rest}")
        rest = rest.removeprefix("shared_transformer.")
        adapter = _ADAPTER.match(rest)
        if adapter:
            where, which, use, part = adapter.groups()
            owner = self.hybrid_layers[int(use)]
            if layer != self.block_of[owner]:
                return None  # another use's block holds the adapters this use runs
            if where == "feed_forward":
                return f"layers.{owner}.feed_forward.adapter.{part}.weight"
            index = "qkv".index(which.removeprefix("linear_")[0])
            return f"layers.{owner}.self_attn.adapters.{index}.{part}.weight"
        return super().checkpoint_name(f"layers.{self.block_of[layer]}.{rest}")

"""MiniMax-Text-01 / MiniMax-M1 (``minimax``): lightning-attention layers (a linear attention
whose state decays by a fixed rate per head) beside full softmax attention with RoPE, and
Mixtral's experts in every layer.

A lightning layer: ``q, k, v = silu(qkv_proj(x))`` (per head ``[q | k | v]``), the state
``S = exp(-slope) S + v k^T`` and ``o = S q`` per head (``kernels.mamba_ssm.lightning_attention``:
the Mamba-2 scan with a unit step), an RMSNorm over all heads, times ``sigmoid(output_gate(x))``,
then ``out_proj``. The slope of head ``h`` (from 0) of layer ``l`` is ``b^(h+1) (1 - l / (L - 1)
+ 1e-5)`` with ``b = 2^(-8 / heads)``. Each sequence keeps an fp32 ``[heads, head_dim,
head_dim]`` state per lightning layer (no conv window).

Every block is normed first and its residual is the normed input, each sum weighted:
``h = norm1(x); h = alpha_attn h + beta_attn attn(h); h = norm2(h); out = alpha_mlp h +
beta_mlp moe(h)`` (the factors differ for lightning and full layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.config_fields import head_dim_of, layer_sliding_window, num_kv_heads_of
from engine.models.hybrid import HybridLayers
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.norm import RMSNorm, ShardedRMSNorm
from engine.models.rotary import RotaryEmbedding
from engine.models.routers import Router
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.parallel.state import divide, tp_rank, tp_size
from engine.state_cache import RecurrentStateSpec
from kernels.mamba_ssm import lightning_attention

LINEAR, FULL = "linear_attention", "full_attention"
# Buffers transformers saves with each lightning layer, recomputed here from the config.
_DERIVED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def lightning_slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """The decay rate of each head of lightning layer ``layer`` (transformers' formula)."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float64) + 1)
    return (rate * (1 - layer / (num_layers - 1 + 1e-5) + 1e-5)).float()


class LightningAttention(nn.Module):
    """One lightning-attention layer over a flat varlen batch; its state is the slot
    ``meta.state_indices`` of the pool bound by ``bind_state``. Past one rank each rank holds
    ``1 / N`` of the heads; the norm over all heads is all-reduced, ``out_proj`` row-parallel."""

    sliding_window = None

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, slopes: torch.Tensor,
                 backend: str) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = divide(num_heads, tp_size(), "num_attention_heads")  # this rank's
        self.head_dim, self.backend = head_dim, backend
        width = num_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(hidden_size, 3 * width, bias=False)
        self.output_gate = ColumnParallelLinear(hidden_size, width, bias=False)
        local = self.num_heads * head_dim
        self.norm = ShardedRMSNorm(local, width, tp_rank() * local, 1e-6)
        self.out_proj = RowParallelLinear(width, hidden_size, bias=False)
        first = tp_rank() * self.num_heads
        self.register_buffer("slope", slopes[first : first + self.num_heads].clone(), False)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        """An fp32 ``[heads, head_dim, head_dim]`` state per sequence, no conv window."""
        return RecurrentStateSpec((0, 0), (self.num_heads, self.head_dim, self.head_dim))

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Use this pool ``[num_slots, ...]`` for the layer's state."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = F.silu(self.qkv_proj(hidden)).view(num_tokens, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=2)
        o = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=torch.float32,
                        device=hidden.device)  # fmt: skip
        lightning_attention(
            q, k, v, self.slope, self.ssm_state, meta.query_start_loc, meta.state_indices,
            meta.has_initial_state, out=o, backend=self.backend,
        )  # fmt: skip
        o = self.norm(o.view(num_tokens, -1)) * torch.sigmoid(self.output_gate(hidden).float())
        return self.out_proj(o.to(hidden.dtype))


class MiniMaxDecoderLayer(nn.Module):
    """Norm first, the normed input as the residual, each sum weighted by (alpha, beta)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 backend: str, attn_factors: tuple[float, float],
                 mlp_factors: tuple[float, float]) -> None:  # fmt: skip
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, backend)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, backend)
        self.attn_factors, self.mlp_factors = attn_factors, mlp_factors
        self.rope_key = None

    def forward(self, rope, hidden, residual, kv_cache, meta):
        h = self.input_layernorm(hidden)
        (a, b), (c, d) = self.attn_factors, self.mlp_factors
        h = h * a + self.self_attn(rope, h, kv_cache, meta) * b
        h = self.post_attention_layernorm(h)
        return h * c + self.mlp(h) * d, None


class MiniMaxForCausalLM(HybridLayers, MoECausalLM):
    """MiniMax's stack: lightning and full attention layers, Mixtral's experts in each."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: must be 'silu'")
        head_dim, hidden, eps = head_dim_of(config), config.hidden_size, config.rms_norm_eps
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position)
        num_layers, heads = config.num_hidden_layers, config.num_attention_heads
        for i, kind in enumerate(config.layer_types):
            if kind == LINEAR:
                mixer = LightningAttention(
                    hidden, heads, head_dim, lightning_slopes(heads, i, num_layers), backend
                )
                factors = (config.linear_attn_alpha_factor, config.linear_attn_beta_factor)
            elif kind == FULL:
                mixer = Attention(
                    hidden, heads, num_kv_heads_of(config), head_dim, backend,
                    AttentionOptions(sliding_window=layer_sliding_window(config, i, max_position)),
                )  # fmt: skip
                factors = (config.full_attn_alpha_factor, config.full_attn_beta_factor)
            else:
                raise ValueError(f"layer_types {kind!r} is not supported: must be one of "
                                 f"{(LINEAR, FULL)}")  # fmt: skip
            experts, top_k = config.num_local_experts, config.num_experts_per_tok
            gate = Router(hidden, experts, top_k, renormalize=True)
            moe = FusedMoE(experts, top_k, hidden, config.intermediate_size, gate,
                           backend=backend)  # fmt: skip
            layer = MiniMaxDecoderLayer(
                mixer, moe, hidden, eps, backend, tuple(map(float, factors)),
                (float(config.mlp_alpha_factor), float(config.mlp_beta_factor)),
            )  # fmt: skip
            layer.rope_key = "default" if kind == FULL else None
            self.layers.append(layer)
        self.norm = RMSNorm(hidden, eps, backend)

    def checkpoint_name(self, name: str) -> str | None:
        """transformers' derived buffers of the lightning layers are recomputed, not read."""
        if name.rsplit(".", 1)[-1] in _DERIVED:
            return None
        return super().checkpoint_name(name)

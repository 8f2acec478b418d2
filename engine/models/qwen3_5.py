"""Qwen3.5 / Qwen3.6 text models (``qwen3_5_text``, ``qwen3_5_moe_text``): hybrid linear
attention. ``layer_types`` (every ``full_attention_interval``-th layer full, the rest linear)
mixes two token mixers:

- Gated DeltaNet (``linear_attention``): ``in_proj_qkv`` -> a short causal depthwise conv with
  SiLU -> the gated delta rule over a per-sequence fp32 state (kernels/gated_delta.py), then an
  RMSNorm gated by ``silu(in_proj_z(x))`` and ``out_proj``. No KV cache: the convolution window
  and the recurrent state live in a state slot per sequence (engine/state_cache.py).
- Gated full attention: q_proj gives a gate per head (output scaled by its sigmoid), per-head
  QK-norm with ``1 + w``, partial rotary (``partial_rotary_factor``, 0.25).

Every RMSNorm but the gated one scales by ``1 + w``. The MoE variant routes softmax top-k
(renormalised) experts plus a sigmoid-gated shared expert in every layer. Qwen3-Next
(``qwen3_next``) is the same stack with its input projections fused per key-head group
(``in_proj_qkvz``, ``in_proj_ba``: reordered at load into ours) and MoE every
``decoder_sparse_step``-th layer outside ``mlp_only_layers``.

Past one rank a Gated DeltaNet layer splits by heads: each rank holds a contiguous ``1 / N`` of
the key heads and of the value heads (so each local key head still serves its own value heads),
their rows of the input projections and conv channels, their ``A_log``, ``dt_bias`` and
recurrent state; the gated norm is per head (replicated) and ``out_proj`` row-parallel (the one
all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import PACKED_MODULES
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.decoder import DecoderLayer
from engine.models.hybrid import HybridLayers, split_by_heads
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE, MoECausalLM
from engine.models.qwen3_moe import is_sparse_layer
from engine.models.rotary import RotaryEmbedding, rope_parameters
from engine.models.routers import Router
from engine.parallel.layers import RowParallelLinear
from engine.parallel.state import divide, tp_size
from engine.state_cache import RecurrentStateSpec
from kernels.causal_conv1d import causal_conv1d
from kernels.gated_delta import gated_delta_rule, gdn_gating

PROJECTIONS = ("split", "qkvz_ba", "separate")
LINEAR = "linear_attention"


class RMSNormGated(nn.Module):
    """``w * rmsnorm(x) * silu(gate)`` as transformers' Qwen3.5 computes it (plain ``w``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer over a flat varlen batch; its conv and recurrent states are
    the slots ``meta.state_indices`` of the pools bound by ``bind_state``."""

    sliding_window = None

    def __init__(
        self,
        config,
        backend: str,
        projections: str = "split",
        beta_scale: float = 1.0,
        norm_eps: float | None = None,
    ) -> None:
        """``projections``: the checkpoint's input-projection tensors besides one whole
        ``in_proj``: "split" (Qwen3.5's ``in_proj_qkv``, ``_z``, ``_b``, ``_a``), "qkvz_ba"
        (Qwen3-Next's two, reordered at load) or "separate" (one per q, k, v, z, b and a, and
        one conv each for q, k and v: OLMo Hybrid); ``beta_scale`` 2 lets beta reach 2 (OLMo
        Hybrid's negative eigenvalues)."""
        if projections not in PROJECTIONS:
            raise ValueError(
                f"projections={projections!r} is not supported: must be one of {PROJECTIONS}"
            )
        super().__init__()
        n = tp_size()  # sizes below are this rank's
        self.num_k_heads = divide(config.linear_num_key_heads, n, "linear_num_key_heads")
        self.num_v_heads = divide(config.linear_num_value_heads, n, "linear_num_value_heads")
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.kernel_size = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        # One GEMM for the four input projections, laid out [q | k | v | z | b | a] (this
        # rank's heads of each); ``shards``: the checkpoint tensors' blocks, whole.
        q, v, h = n * self.key_size, n * self.value_size, n * self.num_v_heads
        # Or one checkpoint tensor in our layout (Lara-Mini's released in_proj).
        shards = {None: [q, q, v, v, h, h]}
        if projections == "qkvz_ba":
            shards |= {"qkvz": [q, q, v, v], "ba": [h, h]}
        elif projections == "separate":
            shards |= {"q": [q], "k": [q], "v": [v], "z": [v], "b": [h], "a": [h]}
        else:
            shards |= {"qkv": [q, q, v], "z": [v], "b": [h], "a": [h]}
        rows = self.conv_dim + self.value_size + 2 * self.num_v_heads
        self.in_proj = nn.Linear(hidden, rows, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        split_by_heads(self.in_proj.weight, shards)
        # OLMo Hybrid's checkpoints keep one conv per q, k and v.
        conv = {"q": [q], "k": [q], "v": [v]} if projections == "separate" else {None: [q, q, v]}
        split_by_heads(self.conv1d.weight, conv)
        split_by_heads(self.dt_bias, {None: [h]})
        split_by_heads(self.A_log, {None: [h]})
        self.norm = RMSNormGated(self.v_dim, norm_eps or config.rms_norm_eps)
        self.beta_scale = beta_scale
        self.out_proj = RowParallelLinear(v, hidden)
        self.backend = backend
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        """What this layer keeps per sequence."""
        return RecurrentStateSpec(
            (self.conv_dim, self.kernel_size - 1), (self.num_v_heads, self.k_dim, self.v_dim)
        )

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Use these pools ``[num_slots, ...]`` for the layer's states."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        proj = self.in_proj(hidden)
        mixed, z, b, a = proj.split(
            [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads], dim=1
        )
        mixed = causal_conv1d(
            mixed.contiguous(), self.conv1d.weight.squeeze(1), None, self.conv_state,
            meta.query_start_loc, meta.state_indices, meta.has_initial_state, "silu",
            backend=self.backend,
        )  # fmt: skip
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=1)
        q = q.reshape(num_tokens, self.num_k_heads, self.k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.v_dim)
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        out = gated_delta_rule(
            q, k, v, g, beta, self.ssm_state, meta.query_start_loc, meta.state_indices,
            meta.has_initial_state, backend=self.backend,
        )  # fmt: skip
        out = self.norm(out.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_size))


class Qwen3_5ForCausalLM(HybridLayers, MoECausalLM):
    """Qwen3.5's hybrid stack (dense MLPs); the MoE variant overrides ``make_mlp``."""

    packed_modules = {
        **PACKED_MODULES,
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }

    projections = "split"  # GatedDeltaNet's checkpoint layout

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        head_dim = head_dim_of(config)
        factor = rope_parameters(config).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        rotary_dim = int(head_dim * factor)
        self.rotaries["default"] = RotaryEmbedding(config, head_dim, max_position, rotary_dim)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_types = list(config.layer_types)
        for i, layer_type in enumerate(self.layer_types):
            if layer_type == LINEAR:
                mixer = GatedDeltaNet(config, backend, self.projections)
            else:
                bias = bool(getattr(config, "attention_bias", False))
                opts = AttentionOptions(
                    qkv_bias=bias, o_bias=bias, qk_norm="head", norm_eps=eps,
                    norm_unit_offset=True, rotary_dim=rotary_dim, output_gate=True,
                )  # fmt: skip
                mixer = Attention(
                    hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim,
                    backend, opts,
                )  # fmt: skip
            layer = DecoderLayer(mixer, self.make_mlp(config, i), hidden, eps, backend,
                                 unit_offset=True)  # fmt: skip
            layer.rope_key = "default"
            self.layers.append(layer)
        self.norm = self.make_norm(unit_offset=True)

    def make_mlp(self, config, i: int) -> nn.Module:
        """Layer ``i``'s feed-forward block."""
        return GatedMLP(config.hidden_size, config.intermediate_size, self.backend)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(name.replace(".linear_attn.", ".self_attn."))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE / Qwen3.6-35B-A3B: routed experts and a gated shared expert in every layer."""

    def make_mlp(self, config, i: int) -> nn.Module:
        hidden = config.hidden_size
        shared = GatedMLP(hidden, config.shared_expert_intermediate_size, self.backend)
        gate = Router(hidden, config.num_experts, config.num_experts_per_tok, renormalize=True,
                      round_weights=True)  # fmt: skip
        return FusedMoE(
            config.num_experts, config.num_experts_per_tok, hidden, config.moe_intermediate_size,
            gate, backend=self.backend, shared_expert=shared, shared_expert_gate=True,
        )  # fmt: skip


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: fused per-group input projections; MoE where ``is_sparse_layer``."""

    projections = "qkvz_ba"
    packed_modules = {
        **PACKED_MODULES,
        "in_proj_qkvz": ("in_proj", "qkvz"),
        "in_proj_ba": ("in_proj", "ba"),
    }

    def make_mlp(self, config, i: int) -> nn.Module:
        if not is_sparse_layer(config, i):
            return super().make_mlp(config, i)
        hidden = config.hidden_size
        shared = GatedMLP(hidden, config.shared_expert_intermediate_size, self.backend)
        gate = Router(hidden, config.num_experts, config.num_experts_per_tok,
                      renormalize=config.norm_topk_prob, round_weights=True)  # fmt: skip
        return FusedMoE(
            config.num_experts, config.num_experts_per_tok, hidden, config.moe_intermediate_size,
            gate, backend=self.backend, shared_expert=shared, shared_expert_gate=True,
        )  # fmt: skip

    def load_weights(self, weights) -> None:
        super().load_weights((name, self._reorder(name, t)) for name, t in weights)

    def _reorder(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Per key-head group ``[q, k, v, z]`` / ``[b, a]`` rows -> ours, ``[q | k | v | z]`` /
        ``[b | a]`` over all heads (transformers' ``fix_query_key_value_ordering``)."""
        c = self.config
        groups, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
        if name.endswith("in_proj_qkvz.weight"):
            kd, vd = c.linear_key_head_dim, r * c.linear_value_head_dim
            parts = tensor.view(groups, 2 * kd + 2 * vd, -1).split([kd, kd, vd, vd], dim=1)
        elif name.endswith("in_proj_ba.weight"):
            parts = tensor.view(groups, 2 * r, -1).split([r, r], dim=1)
        else:
            return tensor
        return torch.cat([p.reshape(-1, tensor.shape[-1]) for p in parts])

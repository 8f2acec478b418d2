"""Kimi Linear (``kimi_linear``): Kimi Delta Attention (KDA) layers beside multi-head latent
attention (MLA) layers, per ``config.layer_types``; a dense SwiGLU where ``mlp_layer_types`` says
``"dense"`` (the first layer), DeepSeek-V3's routed and shared experts elsewhere.

- KDA (``linear_attention``): ``q``, ``k``, ``v`` projections (``linear_num_heads`` heads of
  ``linear_head_dim``) -> one short causal depthwise conv with SiLU over their concatenated
  channels (the checkpoint's ``q_conv1d``, ``k_conv1d``, ``v_conv1d``, stacked) -> the delta rule
  with a decay per key channel (kernels/kimi_delta.py): ``g = -exp(A_log) * softplus(f_b(f_a(x))
  + dt_bias)`` per head and channel, ``beta = sigmoid(b_proj(x))`` per head, q and k
  l2-normalised in the kernel. The output goes through an RMSNorm per head gated by
  ``sigmoid(g_b(g_a(x)))``, then ``o_proj``. No KV cache: per sequence a state slot
  (engine/state_cache.py) keeps the conv window (the last ``linear_conv_kernel_dim - 1`` inputs
  of the ``3 * heads * head_dim`` channels) and the fp32 state ``[heads, head_dim, head_dim]``.
- MLA (``full_attention``): DeepSeek-V3's latent attention (``latent_attention.py``) with no
  positions at all (NoPE): the ``qk_rope_head_dim`` part of each query and the shared key are used
  unrotated. The paged cache keeps one latent row ``[c | k_pe]`` per token, as for DeepSeek-V3.

Past one rank a KDA layer splits by heads: each rank holds ``1 / N`` of the heads (their rows of
the q/k/v/b projections and of ``f_b`` / ``g_b``, their conv channels, ``A_log``, ``dt_bias`` and
state); the low-rank ``f_a`` / ``g_a`` and the per-head norm are replicated, ``o_proj``
row-parallel (the one all-reduce). MLA and the experts split as DeepSeek-V3's do.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.models.decoder import DecoderLayer
from engine.models.deepseek_v3 import is_sparse
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.hybrid import HybridLayers, split_by_heads
from engine.models.latent_attention import LatentAttention
from engine.models.linear import KeepsPackedDtypes, MergedLinear
from engine.models.mlp import GatedMLP
from engine.models.moe import MoECausalLM
from engine.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from engine.parallel.state import divide, tp_rank, tp_size
from engine.state_cache import RecurrentStateSpec
from kernels.causal_conv1d import causal_conv1d
from kernels.kimi_delta import kimi_delta_rule

LINEAR = "linear_attention"
_LAYER = re.compile(r"^layers\.(\d+)\.")
# A KDA layer's checkpoint names -> ours: its q/k/v/b projections and its three convs each land
# in a shard of one merged weight (``packed_modules``); MLA's own ``q_proj`` is left alone.
_KDA_RENAMES = [(f".self_attn.{p}_proj.", f".self_attn.in_proj_{p}.") for p in "qkvb"]
_KDA_RENAMES += [(f".self_attn.{p}_conv1d.", f".self_attn.conv1d_{p}.") for p in "qkv"]


class SigmoidGatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * sigmoid(gate)``, all in fp32, rounded once (transformers'
    ``KimiLinearRMSNormGated``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(KeepsPackedDtypes):
    """One KDA layer over a flat varlen batch; its conv and recurrent states are the slots
    ``meta.state_indices`` of the pools bound by ``bind_state``. ``dt_bias`` stays fp32 in a
    bf16 model, as transformers keeps it."""

    sliding_window = None

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        all_heads, head_dim = config.linear_num_heads, config.linear_head_dim
        self.num_heads = divide(all_heads, tp_size(), "linear_num_heads")  # this rank's
        self.head_dim = head_dim
        self.qkv_dim = self.num_heads * head_dim
        self.kernel_size = config.linear_conv_kernel_dim
        hidden, full = config.hidden_size, all_heads * head_dim
        self.in_proj = MergedColumnParallelLinear(
            hidden, {"q": full, "k": full, "v": full, "b": all_heads}
        )
        self.fg_a_proj = MergedLinear(hidden, {"f_a": head_dim, "g_a": head_dim})
        self.f_b_proj = ColumnParallelLinear(head_dim, full)
        self.g_b_proj = ColumnParallelLinear(head_dim, full)
        conv_dim = 3 * self.qkv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel_size, groups=conv_dim, bias=False)
        # A conv per q, k and v in released checkpoints; one over their concatenation where
        # transformers 5 saved its own layout.
        split_by_heads(self.conv1d.weight, {None: [full] * 3, **{s: [full] for s in "qkv"}})
        self.dt_bias = nn.Parameter(torch.zeros(self.qkv_dim))
        split_by_heads(self.dt_bias, {None: [full]})
        self.dt_bias.keep_dtype = True
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))  # the checkpoint's [1, 1, H, 1]
        self.A_log.weight_loader = self._load_a_log
        self.A_log.checkpoint_shape = lambda shard: (1, 1, all_heads, 1)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(full, hidden)
        self.backend = backend
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def _load_a_log(self, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        param.data.copy_(tensor.reshape(-1).narrow(0, tp_rank() * self.num_heads, self.num_heads))

    def state_spec(self) -> RecurrentStateSpec:
        """What this layer keeps per sequence."""
        return RecurrentStateSpec(
            (3 * self.qkv_dim, self.kernel_size - 1),
            (self.num_heads, self.head_dim, self.head_dim),
        )

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Use these pools ``[num_slots, ...]`` for the layer's states."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        num_tokens, heads, dim = hidden.shape[0], self.num_heads, self.head_dim
        mixed, b = self.in_proj(hidden).split([3 * self.qkv_dim, heads], dim=1)
        mixed = causal_conv1d(
            mixed.contiguous(), self.conv1d.weight.squeeze(1), None, self.conv_state,
            meta.query_start_loc, meta.state_indices, meta.has_initial_state, "silu",
            backend=self.backend,
        )  # fmt: skip
        q, k, v = (x.reshape(num_tokens, heads, dim) for x in mixed.split(self.qkv_dim, dim=1))
        forget, gate = self.gate_inputs(hidden)
        out = kimi_delta_rule(
            q, k, v, self.decay(forget), torch.sigmoid(b.float()), self.ssm_state,
            meta.query_start_loc, meta.state_indices, meta.has_initial_state,
            backend=self.backend,
        )  # fmt: skip
        out = self.o_norm(out, gate.view(num_tokens, heads, dim))
        return self.o_proj(out.reshape(num_tokens, self.qkv_dim))

    def gate_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The forget gate's and the output gate's pre-activations, ``[tokens, qkv_dim]``
        each: Kimi's low-rank ``f_b(f_a(x))`` and ``g_b(g_a(x))``."""
        f_a, g_a = self.fg_a_proj(hidden).split(self.head_dim, dim=1)
        return self.f_b_proj(f_a), self.g_b_proj(g_a)

    def decay(self, forget: torch.Tensor) -> torch.Tensor:
        """fp32 log decay ``[tokens, heads, head_dim]``: ``-exp(A_log) * softplus(f + dt_bias)``,
        with transformers' softplus (``log(1 + exp(x))``, ``x`` past 20)."""
        x = (forget.float() + self.dt_bias.float()).view(-1, self.num_heads, self.head_dim)
        softplus = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
        return -self.A_log.float().exp()[:, None] * softplus


class KimiLinearForCausalLM(HybridLayers, MoECausalLM):
    """Kimi Linear's stack: KDA and MLA layers, a dense first MLP, then experts."""

    packed_modules = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "f_a_proj": ("fg_a_proj", "f_a"),
        "g_a_proj": ("fg_a_proj", "g_a"),
        **{f"in_proj_{p}": ("in_proj", p) for p in "qkvb"},
        **{f"conv1d_{p}": ("conv1d", p) for p in "qkv"},
    }

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_types = list(config.layer_types)
        for i, layer_type in enumerate(self.layer_types):
            if layer_type == LINEAR:
                mixer = KimiDeltaAttention(config, backend)
            else:
                mixer = LatentAttention(config, backend)  # no rope_key: no rotation (NoPE)
            if is_sparse(config, i):
                mlp = Glm4MoeForCausalLM.make_moe(config, backend, config.num_experts)
            else:
                mlp = GatedMLP(hidden, config.intermediate_size, backend)
            layer = DecoderLayer(mixer, mlp, hidden, eps, backend)
            layer.rope_key = None  # no rotary anywhere: the step computes no cos/sin
            self.layers.append(layer)
        self.norm = self.make_norm()

    def checkpoint_name(self, name: str) -> str | None:
        match = _LAYER.match(name)
        if match and self.layer_types[int(match.group(1))] == LINEAR:
            for old, new in _KDA_RENAMES:
                name = name.replace(old, new)
        return super().checkpoint_name(name)

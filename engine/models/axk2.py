"""A.X-K2 (``axk2``, SK Telecom): DeepSeek-V3.2's block (latent attention under DeepSeek Sparse
Attention, ``sparse_attention.py``) with

- one projection ``q_gate_proj`` of ``[q_a_layernorm(q_a), q_a]`` giving each head's query and
  a gate; the attention output scaled by ``sigmoid(gate)`` before ``o_proj``;
- gated RMSNorms (``y = norm(x)``, then ``y * sigmoid(fc2(silu(fc1(y))))``, a low-rank gate) on
  every block's input and before its experts;
- sigmoid routing with a correction bias, in groups only where ``n_group`` is set (the experts
  of the other groups scoring 0), beside a shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.deepseek_v3 import is_sparse
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM
from engine.models.mlp import GatedMLP
from engine.models.moe import FusedMoE
from engine.models.norm import RMSNorm
from engine.models.routers import Router
from engine.models.sparse_attention import IndexedLatentAttention
from engine.parallel.layers import ColumnParallelLinear

_RELEASED_NAMES = (
    (".W_down.", ".mlp.fc1."),
    (".W_up.", ".mlp.fc2."),
    (".self_attn.q_b_proj.", ".self_attn.q_gate_proj."),
)


class GatedRMSNorm(nn.Module):
    """RMSNorm, then a low-rank input-dependent sigmoid gate on its output; called as
    ``RMSNorm`` is (``norm(x)`` or ``norm(x, residual)``)."""

    def __init__(self, hidden_size: int, rank: int, eps: float, backend: str) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, backend)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden_size, rank, bias=False)
        self.mlp.fc2 = nn.Linear(rank, hidden_size, bias=False)

    def _gate(self, y: torch.Tensor) -> torch.Tensor:
        gate = self.mlp.fc2(F.silu(self.mlp.fc1(y)))
        return (y * torch.sigmoid(gate.float())).to(y.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._gate(self.norm(x))
        y, summed = self.norm(x, residual)
        return self._gate(y), summed


class AXK2Attention(IndexedLatentAttention):
    """Sparse latent attention whose query projection also gives an output gate per head."""

    def __init__(self, config, backend: str = "auto") -> None:
        super().__init__(config, backend)
        del self.q_b_proj
        self.q_gate_proj = ColumnParallelLinear(
            2 * config.q_lora_rank,
            config.num_attention_heads * (self.qk_head_dim + self.v_head_dim),
        )

    def project_query(self, q_a: torch.Tensor):
        q_resid = self.q_a_layernorm(q_a)
        q_gate = self.q_gate_proj(torch.cat((q_resid, q_a), dim=-1))
        q_gate = q_gate.view(q_a.shape[0], self.num_heads, self.qk_head_dim + self.v_head_dim)
        q, gate = q_gate.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        return q.reshape(q_a.shape[0], -1), q_resid, gate.reshape(q_a.shape[0], -1)


class AXK2ForCausalLM(DeepseekV32ForCausalLM):
    """A.X-K2: gated norms around the sparse latent attention and the experts."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, rank, eps = config.hidden_size, config.gated_norm_rank, config.rms_norm_eps
        for i, layer in enumerate(self.layers):
            layer.input_layernorm = GatedRMSNorm(hidden, rank, eps, backend)
            if is_sparse(config, i):
                layer.post_attention_layernorm = GatedRMSNorm(hidden, rank, eps, backend)

    def checkpoint_name(self, name: str) -> str | None:
        # Released checkpoints' names (vLLM's layout): the gated norms' low-rank MLP as
        # W_down / W_up, the fused query-and-gate projection as q_b_proj.
        for old, new in _RELEASED_NAMES:
            name = name.replace(old, new)
        return super().checkpoint_name(name)

    def make_attention(self, config, backend: str) -> AXK2Attention:
        return AXK2Attention(config, backend)

    @staticmethod
    def make_moe(config, backend: str) -> FusedMoE:
        """Sigmoid routing with a correction bias (groups where ``n_group`` is set) and the
        shared expert."""
        hidden, experts, top_k = (
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
        )  # fmt: skip
        gate = Router(
            hidden, experts, top_k, scoring="grouped_topk_sigmoid",
            renormalize=config.norm_topk_prob, n_group=config.n_group or 1,
            topk_group=config.topk_group or 1, routed_scaling_factor=config.routed_scaling_factor,
            fp32_weights=True, group_fill=0.0,
        )  # fmt: skip
        inter = config.moe_intermediate_size
        shared = GatedMLP(hidden, inter * config.n_shared_experts, backend)
        return FusedMoE(experts, top_k, hidden, inter, gate, shared_expert=shared, backend=backend)

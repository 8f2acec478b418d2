"""The mixture-of-experts block (vLLM's ``FusedMoE``): a router, ``E`` gated experts stored
fused as 3-D tensors, an optional shared expert.

Weights: ``w13_weight`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
``w2_weight`` ``[E, H, I]``, with ``w13_bias`` / ``w2_bias`` where the experts have biases
(gpt-oss). Activations: ``"silu"`` (``silu(gate) * up``) and ``"swigluoai"`` (gpt-oss:
``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = gate.clamp(max=limit)``).

A step routes its tokens once, then runs every expert's gate_up and down over the tokens routed
to it as grouped GEMMs, with no Python loop over experts: on the CPU pagedq's C++ kernel over
weights packed once at load (``prepack``; ``kernels/cpu_moe.py``), on CUDA a Triton kernel
(``kernels/triton_moe.py``), elsewhere the torch reference (``torch._grouped_mm``).

Past one rank (``engine.parallel.state.moe_parallel``) the router stays replicated and each rank
computes its share of the routed sum, which one all-reduce adds up:

- ``"ep"``: rank ``r`` holds experts ``[r E/N, (r+1) E/N)`` whole and runs them on the
  (token, slot) pairs routed to them only;
- ``"tp"``: every rank holds every expert's ``I/N`` intermediate features (its gate rows, then
  its up rows; its down columns), the down bias added by rank 0 alone.

Each rank loads its slice from the whole checkpoint tensors (per expert or fused) and skips other
ranks' experts; at one rank the block is the plain one (same parameters, same numbers).
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from engine.models.causal_lm import CausalLM
from engine.models.linear import KeepsPackedDtypes
from engine.models.routers import Router
from engine.parallel.state import all_reduce, divide, moe_parallel, tp_rank, tp_size
from kernels import select_backend
from kernels.reference import fused_experts_torch

ACTIVATIONS = ("silu", "swigluoai")


class FusedMoE(KeepsPackedDtypes):
    """``out = sum_j weight_j * expert_j(x)`` over each token's ``top_k`` experts (``gate``
    picks them), plus ``shared_expert(x)`` where one is given, scaled by
    ``sigmoid(shared_expert_gate(x))`` with ``shared_expert_gate=True`` (Qwen2-MoE); the sum
    through ``post_norm`` where one is given (A.X-K1's ``post_mlp_layernorm``).
    ``router_weight_on_input`` (Llama 4): ``out = sum_j expert_j(weight_j * x)``, the input
    scaled in the model's dtype as transformers scales it."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        gate: Router | None = None,
        activation: str = "silu",
        has_bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: bool = False,
        backend: str = "auto",
        post_norm: nn.Module | None = None,
        router_weight_on_input: bool = False,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation={activation!r} is not supported: must be one of {ACTIVATIONS}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.alpha, self.limit = activation, swiglu_alpha, swiglu_limit
        self.backend = backend
        self.gate = gate if gate is not None else Router(hidden_size, num_experts, top_k)
        # This rank's experts [expert0, expert0 + experts) and intermediate features
        # [inter0, inter0 + inter) of each: all of them at one rank.
        n, rank = tp_size(), tp_rank()
        self.parallel = moe_parallel() if n > 1 else None
        experts, inter = num_experts, intermediate_size
        if self.parallel == "ep":
            experts = divide(num_experts, n, "num_experts")
        elif self.parallel == "tp":
            inter = divide(intermediate_size, n, "expert intermediate_size")
        self.expert0 = rank * experts if self.parallel == "ep" else 0
        self.inter0 = rank * inter if self.parallel == "tp" else 0
        self.local_experts, self.local_inter = experts, inter
        # Every weight is loaded next (the loader refuses a checkpoint that misses one).
        self.w13_weight = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(experts, hidden_size, inter))
        self.w13_bias = self.w2_bias = None
        if has_bias:
            self.w13_bias = nn.Parameter(torch.empty(experts, 2 * inter))
            self.w2_bias = nn.Parameter(torch.empty(experts, hidden_size))
        # Each loads from the whole checkpoint tensor (full shape below); per-expert checkpoint
        # tensors are shards (expert, "gate" | "up" | "down") of the weights.
        e, i, h = num_experts, intermediate_size, hidden_size
        for param, kind, full in (
            (self.w13_weight, "w13", (e, 2 * i, h)),
            (self.w2_weight, "w2", (e, h, i)),
            (self.w13_bias, "w13", (e, 2 * i)),
            (self.w2_bias, None, (e, h)),
        ):
            if param is not None:
                param.weight_loader = partial(self._load, kind)
                param.checkpoint_shape = partial(self._checkpoint_shape, full)
        local = range(self.expert0, self.expert0 + experts)
        for param, parts in ((self.w13_weight, ("gate", "up")), (self.w2_weight, ("down",))):
            param.expected_shards = {(e, part) for e in local for part in parts}
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        )
        self.post_mlp_layernorm = post_norm
        self.router_weight_on_input = router_weight_on_input
        self.packed = None  # the C++ kernel's weights, once `prepack` ran
        # (weight type, group sizes of w13 and w2) where the experts stay quantized
        # (engine/quantization/moe.py: packed stacks replace w13_weight and w2_weight).
        self.quant: tuple[str, int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[tokens, hidden]`` through the routed experts (and the shared one)."""
        topk_weights, topk_ids = self.gate(x)
        routed = x
        if self.router_weight_on_input:  # a row per (token, expert), each weight 1
            routed = (x[:, None] * topk_weights[..., None].to(x.dtype)).flatten(0, 1)
            topk_ids = topk_ids.reshape(-1, 1)
            topk_weights = torch.ones_like(topk_ids, dtype=torch.float32)
        if self.parallel is None:
            out = self.experts(routed, topk_weights, topk_ids)
        else:  # summed over the ranks in fp32, rounded once (as one rank's kernel does)
            out = all_reduce(self._rank_share(routed, topk_weights, topk_ids)).to(x.dtype)
        if self.router_weight_on_input and self.top_k > 1:
            out = out.view(x.shape[0], self.top_k, -1).sum(dim=1)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.post_mlp_layernorm is not None:
            out = self.post_mlp_layernorm(out)
        return out

    def _rank_share(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of the routed experts' weighted sum, fp32 ``[tokens, hidden]``."""
        if self.parallel == "tp":
            return self.experts(x, topk_weights, topk_ids, torch.float32)
        # ep: only the (token, slot) pairs routed to this rank's experts, one pair a row.
        ids = topk_ids - self.expert0
        token, slot = ((ids >= 0) & (ids < self.local_experts)).nonzero(as_tuple=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if token.numel():
            pairs = (topk_weights[token, slot, None], ids[token, slot, None])
            out.index_add_(0, token, self.experts(x[token], *pairs, torch.float32))
        return out

    def experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The weighted sum of this rank's experts (``topk_ids`` among them), ``[tokens,
        hidden]`` as ``out_dtype`` (x's dtype, or fp32)."""
        if self.quant is not None:
            from engine.quantization.moe import quantized_experts

            return quantized_experts(self, x, topk_weights, topk_ids, out_dtype)
        options = dict(activation=self.activation, alpha=self.alpha, limit=self.limit)
        if self.packed is not None:
            from kernels.cpu_moe import fused_moe_cpu

            return fused_moe_cpu(
                x, self.packed, topk_weights, topk_ids, **options, out_dtype=out_dtype
            )
        args = (x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        biases = (self.w13_bias, self._down_bias())
        if select_backend(x.device, self.backend) == "triton":
            from kernels.triton_moe import fused_experts_triton

            return fused_experts_triton(*args, *biases, **options, out_dtype=out_dtype)
        return fused_experts_torch(*args, *biases, **options, out_dtype=out_dtype)

    def _down_bias(self) -> torch.Tensor | None:
        # Split by features ("tp"), each rank's down output is a partial sum: rank 0 adds the bias.
        return self.w2_bias if self.inter0 == 0 else None

    def _checkpoint_shape(self, full: tuple[int, ...], shard) -> tuple[int, ...]:
        if shard is None:
            return full
        if not 0 <= shard[0] < self.num_experts:
            raise ValueError(
                f"checkpoint has expert {shard[0]}, but the config has {self.num_experts} experts"
            )
        rows, cols = full[1:]
        return (rows, cols) if shard[1] == "down" else (rows // 2, cols)  # gate or up: half

    def _features(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's intermediate features of ``tensor`` along ``dim``."""
        return tensor.narrow(dim, self.inter0, self.local_inter)

    def _load(self, kind: str | None, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        """This rank's slice of a checkpoint tensor: fused over all experts (``shard`` None) or
        one expert's gate, up or down (skipped where the expert is another rank's). ``kind``:
        "w13" (gate rows, then up rows), "w2" (down: features in the last dim) or None."""
        if shard is None:
            tensor = tensor.narrow(0, self.expert0, self.local_experts)
            if kind == "w13" and self.parallel == "tp":
                tensor = torch.cat([self._features(t, 1) for t in tensor.chunk(2, dim=1)], dim=1)
            elif kind == "w2":
                tensor = self._features(tensor, 2)
            param.data.copy_(tensor)
            return
        expert, part = shard
        expert -= self.expert0
        if not 0 <= expert < self.local_experts:
            return
        if part == "down":
            param.data[expert].copy_(self._features(tensor, 1))
        else:
            rows = slice(0, self.local_inter) if part == "gate" else slice(self.local_inter, None)
            param.data[expert, rows].copy_(self._features(tensor, 0))

    def prepack(self) -> bool:
        """Pack the experts once for the C++ kernel where it runs this dtype (a CPU backend,
        AVX2 or AVX-512, bf16 on AVX-512 with AVX512-BF16); the plain 3-D weights are then
        released. Idempotent; call after loading, with the model on its device and dtype."""
        if self.packed is not None:
            return True
        if self.quant is not None:
            return False
        weight = self.w13_weight
        if select_backend(weight.device, self.backend) != "cpu":
            return False
        from kernels.cpu_moe import fused_moe_available, pack_moe_weights

        if not fused_moe_available(weight.dtype):
            return False
        self.packed = pack_moe_weights(weight, self.w2_weight, self.w13_bias, self._down_bias())
        # Only the packed copy is used from now on: free the plain one (half the memory).
        self.w13_weight = self.w2_weight = None
        self.w13_bias = self.w2_bias = None
        return True


# Checkpoint names of experts: per expert (``experts.N.gate_proj.weight``; Mixtral's first
# checkpoints ``experts.N.w1`` gate, ``w3`` up, ``w2`` down) or fused 3-D (transformers 5).
_PER_EXPERT = re.compile(
    r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|qweight|scales|zeros)$"
)
_FUSED = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_PARTS = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


def expert_target(name: str) -> tuple[str, object] | None:
    """``(FusedMoE parameter name, shard)`` of an expert's checkpoint tensor ``name``, or None
    when ``name`` is not an expert weight."""
    match = _PER_EXPERT.match(name)
    if match:
        prefix, expert, part, kind = match.groups()
        part = _PARTS[part]
        target = f"{'w2' if part == 'down' else 'w13'}_{kind}"  # kind: packed experts' parts
        return f"{prefix}.{target}", (int(expert), part)
    match = _FUSED.match(name)
    if match:
        prefix, which, bias = match.groups()
        stem = "w13" if which == "gate_up_proj" else "w2"
        return f"{prefix}.{stem}_{'bias' if bias else 'weight'}", None
    return None


# Checkpoint module names of MoE families -> ours: Mixtral's first checkpoints, gpt-oss's router,
# GLM-4.5's and DeepSeek-V3's shared experts.
_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".mlp.router.", ".mlp.gate."),
    (".mlp.shared_experts.", ".mlp.shared_expert."),
)


class MoECausalLM(CausalLM):
    """A causal LM whose layers may hold ``FusedMoE`` blocks: loads per-expert and fused expert
    tensors into them and packs them for the CPU kernel."""

    def checkpoint_name(self, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super().checkpoint_name(name)

    def split_target(self, name: str) -> tuple[str, object]:
        return expert_target(name) or super().split_target(name)

    def prepack(self) -> bool:
        packed = super().prepack()
        for module in self.layers.modules():
            if isinstance(module, FusedMoE):
                module.prepack()
        return packed


def from_interleaved_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """gpt-oss's expert tensors in ``FusedMoE``'s layout: its ``gate_up_proj`` ``[E, H, 2I]``
    (gate and up in alternating columns) becomes ``[E, 2I, H]`` (gate rows, then up rows), its
    ``gate_up_proj_bias`` likewise, its ``down_proj`` ``[E, I, H]`` becomes ``[E, H, I]``."""
    if name.endswith("experts.gate_up_proj"):
        tensor = tensor.transpose(1, 2)
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1).contiguous()
    if name.endswith("experts.gate_up_proj_bias"):
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1).contiguous()
    if name.endswith("experts.down_proj"):
        return tensor.transpose(1, 2).contiguous()
    return tensor

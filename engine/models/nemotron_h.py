"""NVIDIA's Nemotron-H / Nemotron Nano (``nemotron_h``): a stack of single-mixer blocks, each
``x + mixer(rmsnorm(x))``, the mixer chosen per layer by ``config.layers_block_type``:

- ``"linear_attention"``: a Mamba-2 layer (engine/models/mamba2.py; ``dt`` clamped below at
  ``time_step_min``);
- ``"full_attention"``: attention without positions (no RoPE at all);
- ``"mlp"``: a ReLU-squared MLP, ``down(relu(up(x)) ** 2)``, no gate;
- ``"moe"``: routed ReLU-squared experts (sigmoid scores with a correction bias, grouped top-k,
  DeepSeek-V3's routing) plus a shared ReLU-squared MLP, optionally through a latent projection.

The experts have no gate, so they run in a loop over the experts a step routes to (pagedq's
fused MoE kernels take gated experts); past one rank each rank runs its share of the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.hybrid import HybridLayers
from engine.models.mamba2 import Mamba2Mixer, backbone_name
from engine.models.norm import RMSNorm
from engine.models.routers import Router
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.parallel.state import all_reduce, divide, tp_rank, tp_size

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"


def relu2(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (transformers' ``relu2``)."""
    return torch.square(F.relu(x))


class ReluSquaredMLP(nn.Module):
    """``down(relu(up(x)) ** 2)``: Nemotron-H's MLP and shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class ReluSquaredMoE(nn.Module):
    """Routed ReLU-squared experts (``up`` ``[E, I, D]``, ``down`` ``[E, D, I]``, ``D`` the
    hidden size or ``moe_latent_size``) plus the shared expert. Past one rank the routed experts
    split by expert: each rank holds ``E / N`` of them and adds what its own experts give, the
    sums all-reduced in fp32 (the shared expert is column/row parallel)."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.n_routed_experts
        latent = config.moe_latent_size
        width = latent if latent is not None else hidden
        self.gate = Router(
            hidden, experts, config.num_experts_per_tok, scoring="grouped_topk_sigmoid",
            renormalize=config.norm_topk_prob, n_group=config.n_group,
            topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
            fp32_weights=True,
        )  # fmt: skip
        local = divide(experts, tp_size(), "n_routed_experts")
        self.expert0 = tp_rank() * local  # this rank's experts: [expert0, expert0 + local)
        inter = config.moe_intermediate_size
        self.up_proj = nn.Parameter(torch.zeros(local, inter, width))
        self.down_proj = nn.Parameter(torch.zeros(local, width, inter))
        for param in (self.up_proj, self.down_proj):
            param.weight_loader = self._load_expert
            param.expected_shards = set(range(self.expert0, self.expert0 + local))
            param.checkpoint_shape = lambda shard, p=param: (
                (experts, *p.shape[1:]) if shard is None else tuple(p.shape[1:])
            )
        self.shared_experts = ReluSquaredMLP(
            hidden, config.moe_shared_expert_intermediate_size, config.mlp_bias
        )
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=config.mlp_bias)
        self.latent = latent is not None

    def _load_expert(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
        """The fused 3-D tensor (this rank's rows of it), or expert ``shard``'s matrix where
        this rank holds that expert."""
        local = param.shape[0]
        if shard is None:
            param.data.copy_(tensor.narrow(0, self.expert0, local))
        elif self.expert0 <= shard < self.expert0 + local:
            param.data[shard - self.expert0].copy_(tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden)
        x = self.fc1_latent_proj(hidden) if self.latent else hidden
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        local = ids - self.expert0
        for expert in local.unique().tolist():
            if not 0 <= expert < self.up_proj.shape[0]:
                continue  # another rank's
            tokens, slot = (local == expert).nonzero(as_tuple=True)
            y = F.linear(relu2(F.linear(x[tokens], self.up_proj[expert])), self.down_proj[expert])
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).float())
        routed = all_reduce(out).to(hidden.dtype)
        if self.latent:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(hidden)


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``; the mixer is ``self_attn`` (Mamba-2 or attention) or ``mlp``,
    so that a block without a token mixer takes neither KV nor a state."""

    def __init__(self, mixer: nn.Module, is_token_mixer: bool, hidden_size: int, eps: float,
                 backend: str) -> None:  # fmt: skip
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, backend)
        if is_token_mixer:
            self.self_attn = mixer
        else:
            self.mlp = mixer
        self.rope_key = None

    def forward(self, rope, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden.float(), self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        mixer = getattr(self, "self_attn", None)
        if mixer is None:
            return self.mlp(hidden), residual
        return mixer(rope, hidden, kv_cache, meta), residual


class NemotronHForCausalLM(HybridLayers, CausalLM):
    """Nemotron-H's block stack and final norm (``norm_f``)."""

    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v")}  # fmt: skip

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        if config.mlp_hidden_act != "relu2":
            raise ValueError(
                f"mlp_hidden_act={config.mlp_hidden_act!r} is not supported: must be 'relu2'"
            )
        if config.mamba_hidden_act != "silu":
            raise ValueError(
                f"mamba_hidden_act={config.mamba_hidden_act!r} is not supported: must be 'silu'"
            )
        self.block_types = list(config.layers_block_type)
        for kind in self.block_types:
            if kind == MAMBA:
                mixer = Mamba2Mixer(
                    hidden, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                    config.ssm_state_size, config.conv_kernel, eps, backend,
                    conv_bias=bool(config.use_conv_bias), proj_bias=bool(config.use_bias),
                    time_step_limit=(config.time_step_min, float("inf")),
                )  # fmt: skip
            elif kind == ATTENTION:
                bias = bool(config.attention_bias)
                mixer = Attention(
                    hidden, config.num_attention_heads, num_kv_heads_of(config),
                    head_dim_of(config), backend, AttentionOptions(qkv_bias=bias, o_bias=bias),
                )  # fmt: skip
            elif kind == MLP:
                mixer = ReluSquaredMLP(hidden, config.intermediate_size, config.mlp_bias)
            elif kind == MOE:
                mixer = ReluSquaredMoE(config)
            else:
                raise ValueError(
                    f"layers_block_type {kind!r} is not supported: must be one of "
                    f"{(MAMBA, ATTENTION, MLP, MOE)}"
                )
            self.layers.append(
                NemotronHBlock(mixer, kind in (MAMBA, ATTENTION), hidden, eps, backend)
            )
        self.norm = RMSNorm(hidden, eps, backend)

    def checkpoint_name(self, name: str) -> str | None:
        """Nemotron-H's names (``backbone.`` or ``model.``) -> ours."""
        name = backbone_name(name)
        if name.startswith("layers."):
            kind = self.block_types[int(name.split(".")[1])]
            ours = ".self_attn." if kind in (MAMBA, ATTENTION) else ".mlp."
            name = name.replace(".mixer.", ours, 1)
        return super().checkpoint_name(name)

    def split_target(self, name: str) -> tuple[str, object]:
        """A routed expert's matrix goes to its row of the 3-D expert tensors."""
        parts = name.split(".")
        if ".mlp.experts." in name:
            i = parts.index("experts")
            if parts[i + 1].isdigit():  # experts.N.up_proj.weight
                return ".".join(parts[:i] + [parts[i + 2]]), int(parts[i + 1])
            return ".".join(parts[:i] + [parts[i + 1]]), None  # experts.up_proj (fused)
        return super().split_target(name)

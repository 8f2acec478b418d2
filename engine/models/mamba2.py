"""The Mamba-2 mixer that hybrid families share (Granite 4.0-H, Nemotron-H, Falcon-H1): a
selective state space over a flat varlen batch, its state in a slot per sequence.

``in_proj`` gives ``[z | x B C | dt]``; a causal depthwise conv (with bias, SiLU) runs over
``x B C``; the scan (kernels/mamba_ssm.py) takes ``x`` ``[T, heads, head_dim]``, ``B``/``C``
``[T, groups, d_state]``, ``dt`` softplus'd with ``dt_bias`` and clamped to
``time_step_limit``, ``A = -exp(A_log)`` and the skip ``D``; then the output is gated by
``silu(z)`` and RMS-normed per group (``norm``: "gated"), or normed then gated
("norm_then_gate"), or only gated (None), and projected back by ``out_proj``. Per sequence the
layer keeps the conv window ``[conv_dim, kernel - 1]`` and the fp32 SSM state
``[heads, head_dim, d_state]`` (engine/state_cache.py), so chunked prefill, prefix snapshots,
swap and recompute work as they do for Gated DeltaNet.

Past one rank the layer splits by heads and by groups: each rank holds ``1 / N`` of the heads
(their rows of ``z``, ``x``, ``dt``, their ``A_log``, ``D``, ``dt_bias``) and of the groups
(``B``, ``C``, and the norm's groups), the conv channels and state that go with them, and
``out_proj`` is row-parallel (the one all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.hybrid import split_by_heads
from engine.parallel.layers import RowParallelLinear
from engine.parallel.state import divide, tp_size
from engine.state_cache import RecurrentStateSpec
from kernels.causal_conv1d import causal_conv1d
from kernels.mamba_ssm import mamba_chunk_scan

NORMS = ("gated", "norm_then_gate", None)
# Mamba-style checkpoints' top-level names (under ``backbone.``) -> ours.
_BACKBONE_NAMES = {
    "embeddings.weight": "embed_tokens.weight",
    "embedding.weight": "embed_tokens.weight",  # state-spaces' own checkpoints
    "norm_f.weight": "norm.weight",
}


def backbone_name(name: str) -> str:
    """A Mamba-style checkpoint name (Mamba-1 and -2, Nemotron-H: ``backbone.embeddings``,
    ``backbone.norm_f``) in the ``CausalLM``'s terms."""
    name = name.removeprefix("backbone.")
    return _BACKBONE_NAMES.get(name, name)


class GroupedRMSNormGated(nn.Module):
    """``w * rmsnorm_per_group(x * silu(z))`` (Mamba-2's ``norm_before_gate=False``), or
    ``w * rmsnorm_per_group(x) * silu(z)`` with ``norm_before_gate``, in fp32, in ``x``'s
    dtype out (the mixer passes fp32)."""

    def __init__(self, size: int, group_size: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf, gate = x.float(), F.silu(z.float())
        if not self.norm_before_gate:
            xf = xf * gate
        groups = xf.view(*xf.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.view_as(xf).to(dtype)
        return (out * gate).to(dtype) if self.norm_before_gate else out


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer over a flat varlen batch; its conv and SSM states are the slots
    ``meta.state_indices`` of the pools bound by ``bind_state``."""

    sliding_window = None

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        conv_kernel: int,
        eps: float,
        backend: str,
        conv_bias: bool = True,
        proj_bias: bool = False,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        norm: str | None = "gated",
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm={norm!r} is not supported: must be one of {NORMS}")
        n = tp_size()  # sizes below are this rank's
        self.num_heads = divide(num_heads, n, "mamba num_heads")
        self.n_groups = divide(n_groups, n, "mamba n_groups")
        self.head_dim, self.d_state, self.kernel_size = head_dim, d_state, conv_kernel
        self.inner = self.num_heads * head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * d_state
        inner, bc = num_heads * head_dim, n_groups * d_state  # whole, as the checkpoint has them
        self.in_proj = nn.Linear(hidden_size, self.inner + self.conv_dim + self.num_heads,
                                 bias=proj_bias)  # fmt: skip
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                bias=conv_bias)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for param in self.in_proj.parameters():
            split_by_heads(param, {None: [inner, inner, bc, bc, num_heads]})
        for param in self.conv1d.parameters():
            split_by_heads(param, {None: [inner, bc, bc]})
        for param in (self.dt_bias, self.A_log, self.D):
            split_by_heads(param, {None: [num_heads]})
        self.norm_kind = norm
        if norm is not None:
            self.norm = GroupedRMSNormGated(
                self.inner, self.inner // self.n_groups, eps, norm == "norm_then_gate"
            )
            split_by_heads(self.norm.weight, {None: [inner]})
        self.out_proj = RowParallelLinear(inner, hidden_size, bias=proj_bias)
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.backend = backend
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        """What this layer keeps per sequence."""
        return RecurrentStateSpec(
            (self.conv_dim, self.kernel_size - 1), (self.num_heads, self.head_dim, self.d_state)
        )

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Use these pools ``[num_slots, ...]`` for the layer's states."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[z | x B C | dt]`` of ``hidden`` (Falcon-H1 scales it)."""
        return self.in_proj(hidden)

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        z, xbc, dt = self.project_in(hidden).split(
            [self.inner, self.conv_dim, self.num_heads], dim=1
        )
        bias = self.conv1d.bias
        xbc = causal_conv1d(
            xbc.contiguous(), self.conv1d.weight.squeeze(1), bias, self.conv_state,
            meta.query_start_loc, meta.state_indices, meta.has_initial_state, "silu",
            backend=self.backend,
        )  # fmt: skip
        bc = self.n_groups * self.d_state
        x, b, c = xbc.split([self.inner, bc, bc], dim=1)
        # The scan's output stays fp32 through the gate and the norm, rounded once before
        # out_proj, as transformers' prefill keeps it (a bf16 round trip there measured 3x HF
        # bf16's KL from fp32 on a tiny Nemotron-H, whose experts then flip).
        y = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=torch.float32,
                        device=hidden.device)  # fmt: skip
        mamba_chunk_scan(
            x.reshape(num_tokens, self.num_heads, self.head_dim), dt,
            -torch.exp(self.A_log.float()),
            b.reshape(num_tokens, self.n_groups, self.d_state),
            c.reshape(num_tokens, self.n_groups, self.d_state),
            self.D, self.dt_bias, self.ssm_state, meta.query_start_loc, meta.state_indices,
            meta.has_initial_state, self.time_step_limit, out=y, backend=self.backend,
        )  # fmt: skip
        y = y.view(num_tokens, self.inner)
        if self.norm_kind is None:
            y = y * F.silu(z.float())
        else:
            y = self.norm(y, z)
        return self.out_proj(y.to(hidden.dtype))

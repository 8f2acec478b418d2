"""The Mamba-1 mixer (``mamba``, ``falcon_mamba``, Jamba's Mamba layers): a selective state
space per channel over a flat varlen batch, its state in a slot per sequence.

``in_proj`` gives ``[x | z]``; a causal depthwise conv (SiLU) runs over ``x``; ``x_proj`` gives
the low-rank time step and ``B``, ``C`` (``[T, state_dim]``, shared by every channel), which
Falcon-Mamba RMS-normalises without weights and Jamba with weights (``bcdt_norm``);
``dt_proj``'s weight lifts the time step to one per channel and its bias is the scan's
``dt_bias``. The scan is Mamba-2's kernel (kernels/mamba_ssm.py) with a head per channel
(``head_dim`` 1), one group and ``A = -exp(A_log)`` ``[channels, state_dim]``: a decay per state
dimension. Its fp32 output is gated by ``silu(z)`` and projected back by ``out_proj``. Per
sequence the layer keeps the conv window ``[channels, kernel - 1]`` and the fp32 SSM state
``[channels, 1, state_dim]`` (engine/state_cache.py).

Past one rank each rank holds ``1 / N`` of the channels (their rows of ``in_proj``, the conv,
``dt_proj``, ``A_log``, ``D``); ``x_proj`` and ``out_proj`` are row-parallel, so the time step
and ``B``, ``C`` are whole on every rank after one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.hybrid import split_by_heads
from engine.models.norm import RMSNorm
from engine.parallel.layers import RowParallelLinear
from engine.parallel.state import divide, tp_size
from engine.state_cache import RecurrentStateSpec
from kernels.causal_conv1d import causal_conv1d
from kernels.mamba_ssm import mamba_chunk_scan

BCDT_NORMS = (None, "weightless", "weighted")


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` in fp32, in ``x``'s dtype out (Falcon-Mamba's weightless norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MambaMixer(nn.Module):
    """One Mamba-1 layer over a flat varlen batch; its conv and SSM states are the slots
    ``meta.state_indices`` of the pools bound by ``bind_state``."""

    sliding_window = None

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        d_state: int,
        conv_kernel: int,
        dt_rank: int,
        backend: str,
        conv_bias: bool = True,
        proj_bias: bool = False,
        bcdt_norm: str | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if bcdt_norm not in BCDT_NORMS:
            raise ValueError(f"bcdt_norm={bcdt_norm!r} is not supported: must be one of "
                             f"{BCDT_NORMS}")  # fmt: skip
        whole = intermediate_size
        self.inner = divide(whole, tp_size(), "mamba intermediate_size")  # this rank's channels
        self.d_state, self.kernel_size, self.dt_rank = d_state, conv_kernel, dt_rank
        self.in_proj = nn.Linear(hidden_size, 2 * self.inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.inner, self.inner, conv_kernel, groups=self.inner,
                                bias=conv_bias)  # fmt: skip
        self.x_proj = RowParallelLinear(whole, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, d_state))
        self.D = nn.Parameter(torch.ones(self.inner))
        for param in self.in_proj.parameters():
            split_by_heads(param, {None: [whole, whole]})
        for param in (*self.conv1d.parameters(), *self.dt_proj.parameters(), self.A_log, self.D):
            split_by_heads(param, {None: [whole]})
        self.out_proj = RowParallelLinear(whole, hidden_size, bias=proj_bias)
        self.bcdt_norm, self.norm_eps = bcdt_norm, norm_eps
        if bcdt_norm == "weighted":
            self.dt_layernorm = RMSNorm(dt_rank, norm_eps, backend)
            self.b_layernorm = RMSNorm(d_state, norm_eps, backend)
            self.c_layernorm = RMSNorm(d_state, norm_eps, backend)
        self.backend = backend
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        """What this layer keeps per sequence."""
        return RecurrentStateSpec((self.inner, self.kernel_size - 1), (self.inner, 1, self.d_state))

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Use these pools ``[num_slots, ...]`` for the layer's states."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def _normed(self, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        if self.bcdt_norm == "weightless":
            return tuple(rms_normalise(t, self.norm_eps) for t in (dt, b, c))
        if self.bcdt_norm == "weighted":
            return self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        return dt, b, c

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        x, z = self.in_proj(hidden).split([self.inner, self.inner], dim=1)
        x = causal_conv1d(
            x.contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, self.conv_state,
            meta.query_start_loc, meta.state_indices, meta.has_initial_state, "silu",
            backend=self.backend,
        )  # fmt: skip
        dt, b, c = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=1)
        dt, b, c = self._normed(dt, b, c)
        dt = F.linear(dt, self.dt_proj.weight).float()  # the bias is the scan's dt_bias
        y = torch.empty(num_tokens, self.inner, 1, dtype=torch.float32, device=hidden.device)
        mamba_chunk_scan(
            x.view(num_tokens, self.inner, 1), dt, -torch.exp(self.A_log.float()),
            b.contiguous().view(num_tokens, 1, self.d_state),
            c.contiguous().view(num_tokens, 1, self.d_state), self.D, self.dt_proj.bias,
            self.ssm_state, meta.query_start_loc, meta.state_indices, meta.has_initial_state,
            out=y, backend=self.backend,
        )  # fmt: skip
        y = y.view(num_tokens, self.inner) * F.silu(z.float())
        return self.out_proj(y.to(hidden.dtype))

"""Dense feed-forward blocks: SwiGLU (Llama), GeGLU (Gemma) and the plain GeLU MLP (Falcon,
GPT-Neo)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from kernels import silu_and_mul

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up merged into one projection."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        backend: str = "auto",
        bias: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act={activation!r} is not supported: must be one of {ACTIVATIONS}"
            )
        self.backend = backend
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.activation == "silu":
            if getattr(gate_up, "fuses_silu_and_mul", False):  # pagedq's GEMM, same numbers
                return self.down_proj(gate_up.silu_and_mul(x))
            return self.down_proj(silu_and_mul(gate_up(x), backend=self.backend))
        gate, up = gate_up(x).chunk(2, dim=-1)
        approximate = "none" if self.activation == "gelu" else "tanh"
        return self.down_proj(F.gelu(gate, approximate=approximate) * up)


class GeluMLP(nn.Module):
    """``dense_4h_to_h(gelu(dense_h_to_4h(x)))``, the two-matrix MLP of Falcon and GPT-Neo
    (``approximate="tanh"``: GPT-Neo's ``gelu_new``)."""

    def __init__(
        self, hidden_size: int, ffn_size: int, bias: bool, approximate: str = "none"
    ) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, ffn_size, bias=bias)
        self.dense_4h_to_h = RowParallelLinear(ffn_size, hidden_size, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.dense_h_to_4h(x), approximate=self.approximate)
        return self.dense_4h_to_h(hidden)

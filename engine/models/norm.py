"""RMSNorm as Hugging Face computes it: in fp32, cast back."""

from __future__ import annotations

import torch
from torch import nn

from kernels import rms_norm


class RMSNorm(nn.Module):
    """``norm(x)`` gives the normed ``x``; ``norm(x, residual)`` adds first and gives
    ``(normed, x + residual)`` (one C++ pass on the CPU, which may reuse ``residual``'s memory).

    ``unit_offset`` (Gemma): the checkpoint stores ``w`` and the scale is ``1 + w``; it is added
    once at load (in fp32, as Gemma's forward adds it), so the kernel is the plain one.
    """

    def __init__(
        self,
        size: int,
        eps: float,
        backend: str = "auto",
        unit_offset: bool = False,
        with_scale: bool = True,
    ) -> None:
        super().__init__()
        if not with_scale:  # a norm with no learned scale (Gemma 4's v_norm): weight of ones
            self.register_buffer("weight", torch.ones(size), persistent=False)
        else:
            self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend
        if unit_offset:
            self.weight.weight_loader = _load_unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        normed, summed = rms_norm(x, self.weight, self.eps, residual, backend=self.backend)
        return normed if residual is None else (normed, summed)


def _load_unit_offset(param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
    param.data.copy_(1.0 + tensor.float())

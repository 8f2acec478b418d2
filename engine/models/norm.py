"""RMSNorm in fp32 with an fp32 scale, cast back once."""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel.state import all_reduce
from kernels import rms_norm


class RMSNorm(nn.Module):
    """``norm(x)`` gives the normed ``x``; ``norm(x, residual)`` adds first and gives
    ``(normed, x + residual)`` (one C++ pass on the CPU, which may reuse ``residual``'s memory).

    ``unit_offset`` (Gemma): the checkpoint stores ``w`` and the scale is ``1 + w``; it is added
    once at load (in fp32, as Gemma's forward adds it), so the kernel is the plain one.

    The scale stays fp32 in a bf16 model (``model.to(dtype)`` moves it, never rounds it): ``1 + w``
    is rarely a bf16 number, and scaling in fp32 then rounding once keeps the bf16 model as close
    to fp32 as Hugging Face's bf16, or closer (bench/fidelity.py).
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

    def _apply(self, fn, recurse: bool = True):
        weight = self.weight.detach()  # the fp32 values, whatever fn does to the parameter
        super()._apply(fn, recurse)
        if weight.dtype == torch.float32 and self.weight.dtype != torch.float32:
            self.weight.data = weight.to(self.weight.device)  # moved, not rounded
        return self

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        normed, summed = rms_norm(x, self.weight, self.eps, residual, backend=self.backend)
        return normed if residual is None else (normed, summed)


def _load_unit_offset(param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
    param.data.copy_(1.0 + tensor.float())


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a projection whose features are split over the tensor-parallel ranks (OLMo's
    QK-norm over all heads of q or k): each rank holds ``size`` features from ``offset`` of the
    ``full_size`` and their part of ``weight``; the sum of squares is all-reduced. ``copies``:
    how many ranks hold each feature (a KV head replicated over ``N / kv_heads`` ranks)."""

    def __init__(self, size: int, full_size: int, offset: int, eps: float, copies: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.weight.weight_loader = self._load
        self.weight.checkpoint_shape = lambda shard: (full_size,)
        self.full_size, self.offset, self.eps, self.copies = full_size, offset, eps, copies

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        param.data.copy_(tensor.narrow(0, self.offset, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        square_sum = all_reduce(xf.pow(2).sum(-1, keepdim=True))
        variance = square_sum / (self.full_size * self.copies)
        return (self.weight.float() * (xf * torch.rsqrt(variance + self.eps))).to(x.dtype)

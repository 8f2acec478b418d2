"""``QuantizedLinear``: a linear layer whose weight stays packed (``kernels/quant_linear.py``'s
layout) and runs through the weight-only quantized GEMM.

It takes the place of a built layer (plain, merged, column- or row-parallel) before the weights
load, and keeps that layer's way of loading: each packed tensor has the output rows of the
weight, so the layer's own loader puts every shard (q/k/v, gate/up) and every rank's rows where
the weight's would go; a row-parallel layer's ranks take their columns of ``qweight`` and their
groups of ``scales`` and ``zeros``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.linear import KeepsPackedDtypes, MergedLinear
from engine.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.parallel.state import all_reduce, tp_rank, tp_size
from kernels.quant_linear import quant_linear

SWAPPABLE = (
    nn.Linear, MergedLinear, ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
    RowParallelLinear,
)  # fmt: skip


def swappable(module: nn.Module) -> bool:
    """True for a linear layer ``QuantizedLinear`` can replace: one of pagedq's linear classes
    (not a subclass with its own forward) whose weight nothing else reads (``no_prepack``:
    MLA's ``kv_b_proj``, split into heads each step) and that has no loader of its own."""
    if type(module) not in SWAPPABLE or getattr(module, "no_prepack", False):
        return False
    loader = getattr(module.weight, "weight_loader", None)
    return loader is None or getattr(loader, "__self__", None) is module


class QuantizedLinear(KeepsPackedDtypes):
    """``y = x @ dequantize(W).T + b`` of the layer it replaces, ``W`` packed; past one rank
    a row-parallel layer all-reduces as before."""

    def __init__(
        self, base: nn.Linear, weight_type: str, groups: int, has_zeros: bool, has_perm: bool
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight_type = weight_type
        self.row_parallel = isinstance(base, RowParallelLinear) and tp_size() > 1
        n, k = base.out_features, base.in_features
        # Channel-wise scales (one group) are whole on every rank of a row-parallel layer.
        local_groups = groups if groups == 1 or not self.row_parallel else groups // tp_size()
        if local_groups * tp_size() != groups and self.row_parallel and groups != 1:
            raise ValueError(
                f"{groups} quantization groups of in_features={k * tp_size()} do not split over "
                f"tensor_parallel_size={tp_size()}"
            )
        if k % local_groups:
            raise ValueError(f"{local_groups} quantization groups do not divide in_features={k}")
        self.group_size = k // local_groups
        if has_perm and self.row_parallel:
            raise ValueError(
                "act order (GPTQ desc_act, compressed-tensors actorder=group) on a row-parallel "
                f"layer is not supported at tensor_parallel_size={tp_size()}: must be 1"
            )
        width = k // 2 if weight_type == "uint4" else k
        qdtype = torch.float8_e4m3fn if weight_type == "float8_e4m3fn" else torch.uint8
        self.qweight = _param(torch.empty(n, width, dtype=qdtype))
        self.scales = _param(torch.empty(n, local_groups, dtype=torch.float32))
        self.zeros = _param(torch.empty(n, local_groups)) if has_zeros else None
        self.perm = _param(torch.empty(k, dtype=torch.long)) if has_perm else None
        self.bias = base.bias
        self._perm_loaded = False
        for name in ("qweight", "scales", "zeros"):
            param = getattr(self, name)
            if param is not None:
                self._loads_like(param, base, groups == 1 and name != "qweight")
        if self.perm is not None:
            self.perm.weight_loader = self._load_perm
            if hasattr(base.weight, "expected_shards"):
                self.perm.expected_shards = base.weight.expected_shards
                self.perm.shard_shape = lambda shard: (k,)

    def _loads_like(self, param: nn.Parameter, base: nn.Linear, whole_columns: bool) -> None:
        """``param`` loads as ``base.weight`` does along its rows; past one rank a row-parallel
        layer takes this rank's columns (all of them where ``whole_columns``)."""
        weight = base.weight
        if self.row_parallel:
            cols = param.shape[1]
            full = cols if whole_columns else cols * tp_size()
            param.checkpoint_shape = lambda shard: (param.shape[0], full)
            start = 0 if whole_columns else tp_rank() * cols
            param.weight_loader = lambda p, t, shard: p.data.copy_(t.narrow(1, start, cols))
            return
        if hasattr(weight, "weight_loader"):
            param.weight_loader = weight.weight_loader
        if hasattr(weight, "expected_shards"):
            param.expected_shards = weight.expected_shards
        if hasattr(weight, "checkpoint_shape"):
            rows = weight.checkpoint_shape
            param.checkpoint_shape = lambda shard: (rows(shard)[0], *param.shape[1:])

    def _load_perm(self, param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
        if not self._perm_loaded:
            param.data.copy_(tensor)
            self._perm_loaded = True
        elif not torch.equal(param.data, tensor):
            raise ValueError(
                f"the act-order permutations of the projections merged into one layer differ "
                f"(shard {shard!r}): pagedq runs them as one GEMM over one input order"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        bias = None if self.bias is None else self.bias.float()
        args = (self.qweight, self.scales, self.zeros, self.weight_type, self.group_size)
        if not self.row_parallel:
            return quant_linear(x, *args, bias)
        y = all_reduce(quant_linear(x, *args))
        return y if bias is None else y + bias.to(y.dtype)


def _param(t: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(t, requires_grad=False)
    param.keep_dtype = True
    return param

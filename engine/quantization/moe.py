"""MoE experts kept packed: a ``FusedMoE``'s ``w13`` (gate rows, then up rows) and ``w2``
(down) as ``[E, rows, ...]`` stacks of ``kernels/quant_linear.py``'s layout, loaded per expert
as AWQ, GPTQ and compressed-tensors store them, run expert by expert over the (token, slot)
pairs routed to each (only the experts a step routes to are read)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from engine.parallel.state import tp_rank, tp_size
from kernels.quant_linear import quant_linear
from kernels.reference import moe_activation_torch

PARTS = ("qweight", "scales", "zeros")


def quantize_experts(moe, weight_type: str, groups13: int, groups2: int, has_zeros: bool) -> None:
    """Replace ``moe``'s plain ``w13_weight`` / ``w2_weight`` by packed stacks (``groups``:
    quantization groups over each projection's whole input)."""
    experts, rows13, hidden = moe.w13_weight.shape
    inter = moe.w2_weight.shape[2]
    split = moe.parallel == "tp"  # the down projection's input (intermediate) is split
    local2 = groups2 if groups2 == 1 or not split else groups2 // tp_size()
    if local2 * (tp_size() if split and groups2 > 1 else 1) != groups2 or inter % local2:
        raise ValueError(
            f"{groups2} quantization groups of the experts' intermediate_size do not split over "
            f"tensor_parallel_size={tp_size()} (--moe-parallel tp)"
        )
    if hidden % groups13:
        raise ValueError(f"{groups13} quantization groups do not divide hidden_size={hidden}")
    expected = {"w13": moe.w13_weight.expected_shards, "w2": moe.w2_weight.expected_shards}
    del moe.w13_weight, moe.w2_weight
    moe.w13_weight = moe.w2_weight = None
    moe.quant = (weight_type, hidden // groups13, inter // local2)
    width = (lambda k: k // 2) if weight_type == "uint4" else (lambda k: k)
    qdtype = torch.float8_e4m3fn if weight_type == "float8_e4m3fn" else torch.uint8
    for stem, rows, cols, groups, full_groups in (
        ("w13", rows13, hidden, groups13, groups13),
        ("w2", hidden, inter, local2, groups2),
    ):
        shapes = {
            "qweight": ((experts, rows, width(cols)), qdtype),
            "scales": ((experts, rows, groups), torch.float32),
            "zeros": ((experts, rows, groups), torch.float32),
        }
        for part in PARTS:
            if part == "zeros" and not has_zeros:
                continue
            shape, dtype = shapes[part]
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.keep_dtype = True
            whole = part != "qweight" and full_groups == 1
            param.weight_loader = partial(_load, moe, stem, whole)
            param.checkpoint_shape = partial(_checkpoint_shape, moe, stem, param, whole)
            param.expected_shards = expected[stem]
            moe.register_parameter(f"{stem}_{part}", param)


def _checkpoint_shape(moe, stem: str, param, whole: bool, shard) -> tuple[int, ...]:
    if shard is None:
        raise ValueError("packed experts load per expert (experts.N.gate_proj.qweight ...)")
    rows, cols = param.shape[1:]
    if stem == "w13":  # gate or up: half the rows, all of them at every rank
        return (rows // 2 * (tp_size() if moe.parallel == "tp" else 1), cols)
    return (rows, cols * (tp_size() if moe.parallel == "tp" and not whole else 1))


def _load(moe, stem: str, whole: bool, param, tensor: torch.Tensor, shard) -> None:
    expert, part = shard
    expert -= moe.expert0
    if not 0 <= expert < moe.local_experts:
        return
    if stem == "w2":
        cols = param.shape[2]
        start = 0 if whole or moe.parallel != "tp" else tp_rank() * cols
        param.data[expert].copy_(tensor.narrow(1, start, cols))
        return
    half = param.shape[1] // 2
    rows = slice(0, half) if part == "gate" else slice(half, None)
    param.data[expert, rows].copy_(tensor.narrow(0, moe.inter0, half))


def quantized_experts(
    moe,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``FusedMoE.experts`` over packed stacks: the weighted sum of each token's experts,
    as ``out_dtype`` (x's dtype, or fp32), with the reference's roundings
    (``kernels/reference.py``'s ``fused_experts_torch``)."""
    weight_type, group13, group2 = moe.quant
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=moe.local_experts).tolist()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1)
    zeros13, zeros2 = getattr(moe, "w13_zeros", None), getattr(moe, "w2_zeros", None)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = order[start : start + count]
        start += count
        token = rows // top_k
        z13 = None if zeros13 is None else zeros13[expert]
        gate_up = quant_linear(
            x[token], moe.w13_qweight[expert], moe.w13_scales[expert], z13, weight_type, group13
        )
        if moe.w13_bias is not None:
            gate_up = gate_up + moe.w13_bias[expert].to(gate_up.dtype)
        hidden = moe_activation_torch(gate_up, moe.activation, moe.alpha, moe.limit)
        z2 = None if zeros2 is None else zeros2[expert]
        y = quant_linear(
            hidden, moe.w2_qweight[expert], moe.w2_scales[expert], z2, weight_type, group2
        )
        bias = moe._down_bias()
        if bias is not None:
            y = y + bias[expert].to(y.dtype)
        out.index_add_(0, token, y.float() * weights[rows, None].float())
    return out.to(out_dtype or x.dtype)

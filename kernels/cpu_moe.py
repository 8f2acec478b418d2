"""Mixture-of-experts layers on pagedq's CPU GEMM (``kernels/csrc/moe_cpu.cpp``).

Each expert's gate_up and down weights are packed once, as ``kernels.cpu_linear`` packs a
projection, and stacked; one ``fused_moe`` call then runs a whole layer's experts: the routed
(token, slot) pairs sorted by expert, each expert's rows as one GEMM per weight block, threads
over (expert, column block) tasks, the activation and the weighted sum in the epilogues.
fp32 and bf16 need an AVX2 (with FMA) or AVX-512 build, bf16 on AVX-512 AVX512-BF16 too
(AVX2 widens bf16 weights to fp32 in registers); elsewhere ``fused_moe_available`` is False and
the torch reference (``kernels.reference.fused_experts_torch``) runs.
"""

from __future__ import annotations

import torch

from kernels import cpu_attention

ACTIVATIONS = {"silu": 0, "swigluoai": 1}
BLOCK = 64  # output features per packed column block


def fused_moe_available(dtype: torch.dtype) -> bool:
    """True where the C++ kernels are built and this build has the expert GEMMs for ``dtype``."""
    if not cpu_attention.cpu_kernels_available():
        return False
    return bool(torch.ops.pagedq.fused_moe_available(dtype))


def padded_intermediate(intermediate: int) -> int:
    """The intermediate size rounded up to whole column blocks (the padding is zeros)."""
    return -(-intermediate // BLOCK) * BLOCK


def pack_moe_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Stacked packed ``(w13, w2, w13_bias, w2_bias)`` for ``fused_moe_cpu`` from the plain
    ``w13`` ``[E, 2I, H]`` (gate rows, then up rows), ``w2`` ``[E, H, I]`` and their biases;
    the intermediate is zero-padded to whole blocks, the biases become fp32."""
    cpu_attention._require()
    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    ip = padded_intermediate(inter)
    pack = torch.ops.pagedq.pack_linear_weight
    gate_up = w13.new_zeros(2 * ip, hidden)
    down = w2.new_zeros(hidden, ip)
    packed13 = packed2 = None
    with torch.no_grad():
        for e in range(experts):  # once, at load; into one tensor (no second copy of all)
            gate_up[:inter], gate_up[ip : ip + inter] = w13[e, :inter], w13[e, inter:]
            down[:, :inter] = w2[e]
            one13, one2 = pack(gate_up), pack(down)
            if packed13 is None:
                packed13 = one13.new_empty(experts, *one13.shape)
                packed2 = one2.new_empty(experts, *one2.shape)
            packed13[e], packed2[e] = one13, one2
        bias13 = None
        if w13_bias is not None:
            bias13 = torch.zeros(experts, 2 * ip)
            bias13[:, :inter], bias13[:, ip : ip + inter] = w13_bias[:, :inter], w13_bias[:, inter:]
        bias2 = None if w2_bias is None else w2_bias.detach().float().contiguous()
    return packed13, packed2, bias13, bias2


def fused_moe_cpu(
    x: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` over ``pack_moe_weights``'
    weights, as ``out_dtype`` (x's dtype, or fp32)."""
    w13, w2, b13, b2 = packed
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype)
    torch.ops.pagedq.fused_moe(
        x,
        w13,
        w2,
        b13,
        b2,
        topk_weights.float().contiguous(),
        topk_ids.long().contiguous(),
        ACTIVATIONS[activation],
        alpha,
        limit,
        out,
    )
    return out

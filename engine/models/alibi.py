"""ALiBi's per-head slopes (Press et al., 2021) as BLOOM and MPT compute them: the attention
kernels add ``slope * (key - query position)`` to each head's scores
(``kernels.attention_options``), so a family gives only its slopes."""

from __future__ import annotations

import math

import torch


def bloom_slopes(num_heads: int) -> list[float]:
    """BLOOM's slopes (``build_alibi_tensor``): ``2 ** (-8 i / n)`` for the largest power of two
    n <= heads, then the odd powers of the next power's base for the heads beyond it."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base, dtype=torch.float32), torch.arange(1, 1 + closest))
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(
            torch.tensor(extra_base, dtype=torch.float32), torch.arange(1, 1 + 2 * remaining, 2)
        )
        slopes = torch.cat([slopes, extra])
    return slopes.tolist()


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8) -> list[float]:
    """MPT's slopes (``build_mpt_alibi_tensor``): ``1 / 2 ** (i * bias_max / n)`` over the next
    power of two n >= heads, the odd-indexed ones first where heads fall short of it."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, padded + 1, dtype=torch.int64).float() * (alibi_bias_max / padded)
    slopes = 1.0 / torch.pow(2, base)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes.tolist()

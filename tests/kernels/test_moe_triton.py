"""The Triton fused-MoE kernel (run by Triton's interpreter here) equals the torch reference on
tiny shapes: experts with no rows and with more rows than a block, sizes off the blocks, both
activations, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import fused_experts_torch
from kernels.triton_moe import fused_experts_triton, moe_align_block_size


def test_align_block_size_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]])
    sorted_ids, expert_ids = moe_align_block_size(ids, num_experts=5, block_m=2)
    pad = ids.numel()
    # expert 0: pairs 1, 4; expert 1: pair 7 + pad; expert 2: 0, 2, 5, 6; expert 3: 3 + pad.
    assert sorted_ids.tolist() == [1, 4, 7, pad, 0, 2, 5, 6, 3, pad]
    assert expert_ids.tolist() == [0, 1, 2, 2, 3]


@pytest.mark.parametrize(
    ("dtype", "activation", "tokens", "hidden", "inter"),
    [
        (torch.float32, "silu", 9, 40, 24),
        (torch.float32, "swigluoai", 5, 32, 40),
        (torch.bfloat16, "silu", 7, 48, 32),
    ],
)
def test_triton_matches_torch_reference(dtype, activation, tokens, hidden, inter, rng):
    experts, top_k = 6, 2
    x = torch.randn(tokens, hidden, generator=rng).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=rng) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=rng) * inter**-0.5).to(dtype)
    b13 = b2 = None
    if activation == "swigluoai":
        b13 = torch.randn(experts, 2 * inter, generator=rng) * 0.3
        b2 = torch.randn(experts, hidden, generator=rng) * 0.3
    ids = torch.stack([torch.randperm(experts - 1, generator=rng)[:top_k] for _ in range(tokens)])
    ids[:, 0] = 1  # expert 1 gets every token (more rows than a block); expert 5 none
    weights = torch.rand(tokens, top_k, generator=rng)
    args = (x, w13, w2, weights, ids, b13, b2, activation)
    got = fused_experts_triton(*args)
    expected = fused_experts_torch(*args)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)

"""The C++ grouped expert GEMMs (kernels/csrc/moe_cpu.cpp) and the torch reference compute a
mixture-of-experts layer as a plain per-expert loop in float64 does: experts with no token, one
token and many; hidden and intermediate sizes off the 64-wide blocks (odd for bf16's pairs);
SiLU-and-mul and gpt-oss's clamped SwiGLU with biases; fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_moe import fused_moe_available, fused_moe_cpu, pack_moe_weights
from kernels.reference import fused_experts_torch, moe_activation_torch

fp32, bf16 = torch.float32, torch.bfloat16


def needs(dtype: torch.dtype):
    return pytest.mark.skipif(
        not fused_moe_available(dtype), reason=f"no C++ expert GEMMs for {dtype} in this build"
    )


def routed(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    """Ids where expert 0 gets no token, expert 1 exactly one, expert 2 every token, the rest
    at random; weights in (0, 1)."""
    ids = torch.empty(tokens, top_k, dtype=torch.long)
    for t in range(tokens):
        others = torch.randperm(experts - 3, generator=gen)[: top_k - 1] + 3
        ids[t] = torch.cat((torch.tensor([2]), others))
    if tokens > 1:
        ids[tokens // 2, 1] = 1
    return torch.rand(tokens, top_k, generator=gen), ids


def per_expert_float64(x, w13, w2, weights, ids, b13, b2, activation):
    """Each (token, slot) through its own expert's weights, summed by weight, in float64."""
    h = torch.einsum("tkoh,th->tko", w13[ids].double(), x.double())
    if b13 is not None:
        h = h + b13[ids].double()
    act = moe_activation_torch(h, activation)
    y = torch.einsum("tkhi,tki->tkh", w2[ids].double(), act)
    if b2 is not None:
        y = y + b2[ids].double()
    return (weights.double()[..., None] * y).sum(dim=1)


def case(tokens, hidden, inter, experts, top_k, activation, with_bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    b13 = torch.randn(experts, 2 * inter, generator=gen) * 0.5 if with_bias else None
    b2 = torch.randn(experts, hidden, generator=gen) * 0.5 if with_bias else None
    weights, ids = routed(tokens, experts, top_k, gen)
    return x, w13, w2, weights, ids, b13, b2


# (tokens, hidden, intermediate, experts, top_k): one token, a micro-kernel's rows and more,
# sizes off the blocks (odd hidden), a prefill chunk.
SHAPES = [(1, 64, 64, 4, 2), (7, 96, 48, 6, 3), (13, 33, 70, 8, 4), (150, 130, 64, 9, 2)]
ACTS = [("silu", False), ("swigluoai", True)]


@pytest.mark.parametrize("dtype", [fp32, bf16])
@pytest.mark.parametrize(("activation", "with_bias"), ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernel_matches_float64(shape, activation, with_bias, dtype):
    if not fused_moe_available(dtype):
        pytest.skip(f"no C++ expert GEMMs for {dtype} in this build")
    args = case(*shape, activation, with_bias, dtype, seed=sum(shape))
    x, w13, w2, weights, ids, b13, b2 = args
    exact = per_expert_float64(x, w13, w2, weights, ids, b13, b2, activation)
    packed = pack_moe_weights(w13, w2, b13, b2)
    got = fused_moe_cpu(x, packed, weights, ids, activation)
    assert got.dtype == dtype and got.shape == x.shape
    # bf16 rounds the gate/up, activation and down values as a bf16 model does: a few ulps.
    scale = exact.abs().max()
    tol = 1e-5 if dtype == fp32 else 3e-2
    assert (got.double() - exact).abs().max() <= tol * scale
    if dtype == bf16:  # fp32 out: the same sums, not rounded at the end
        wide = fused_moe_cpu(x, packed, weights, ids, activation, out_dtype=fp32)
        assert torch.equal(wide.to(bf16), got)


@pytest.mark.parametrize("grouped_mm", [True, False])
@pytest.mark.parametrize(("activation", "with_bias"), ACTS)
def test_torch_reference_matches_float64(activation, with_bias, grouped_mm, monkeypatch):
    if not grouped_mm:  # the padded-bmm fallback of a torch without _grouped_mm
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    args = case(13, 32, 48, 8, 4, activation, with_bias, fp32, seed=3)
    x, w13, w2, weights, ids, b13, b2 = args
    exact = per_expert_float64(x, w13, w2, weights, ids, b13, b2, activation)
    got = fused_experts_torch(x, w13, w2, weights, ids, b13, b2, activation)
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


@needs(fp32)
def test_tokens_with_no_rows_and_bad_ids():
    x, w13, w2, weights, ids, _, _ = case(5, 64, 64, 4, 2, "silu", False, fp32, seed=1)
    packed = pack_moe_weights(w13, w2)
    assert fused_moe_cpu(x[:0], packed, weights[:0], ids[:0]).shape == (0, 64)
    with pytest.raises(RuntimeError, match="expert id 4 is not in"):
        fused_moe_cpu(x, packed, weights, torch.full_like(ids, 4))
    # The same numbers whatever the thread count (each output element has one writer).
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_moe_cpu(x, packed, weights, ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, fused_moe_cpu(x, packed, weights, ids))


def _amx_here() -> bool:
    from kernels.cpu_attention import amx_decode_available, cpu_kernels_available

    return cpu_kernels_available() and amx_decode_available() and fused_moe_available(bf16)


# Experts with 16 or more rows (a prefill's) run bf16 on AMX tiles: whole and partial tiles of
# rows, a hidden size with a half column block (96), an intermediate padded to a block (96).
AMX_SHAPES = [(150, 96, 64, 9, 2), (70, 128, 96, 8, 3), (40, 64, 64, 4, 2)]


@pytest.mark.skipif(not _amx_here(), reason="no AMX here (or PAGEDQ_CPU_AMX=0)")
@pytest.mark.parametrize(("activation", "with_bias"), ACTS)
@pytest.mark.parametrize("shape", AMX_SHAPES)
def test_amx_experts_match_float64_and_the_avx_path(shape, activation, with_bias, monkeypatch):
    args = case(*shape, activation, with_bias, bf16, seed=sum(shape))
    x, w13, w2, weights, ids, b13, b2 = args
    exact = per_expert_float64(x, w13, w2, weights, ids, b13, b2, activation)
    packed = pack_moe_weights(w13, w2, b13, b2)
    amx = fused_moe_cpu(x, packed, weights, ids, activation, out_dtype=fp32)
    monkeypatch.setenv("PAGEDQ_CPU_AMX", "0")
    avx = fused_moe_cpu(x, packed, weights, ids, activation, out_dtype=fp32)
    scale = exact.abs().max()
    assert (amx.double() - exact).abs().max() <= 3e-2 * scale
    # The same products summed in another order: the intermediate's bf16 roundings may differ
    # by an ulp, no more.
    assert (amx - avx).abs().max() <= 2e-2 * scale
    assert not torch.equal(amx, avx) or shape[1] <= 64  # the tile path did run

"""The C++ RMSNorm (plain and fused with the residual add), SiLU-and-mul, argmax and the
grammar bitmask equal torch."""

import pytest
import torch

from kernels import argmax, rms_norm, silu_and_mul
from kernels.cpu_attention import (
    apply_token_bitmask_cpu,
    argmax_cpu,
    cpu_kernels_available,
    rms_norm_cpu,
    silu_and_mul_cpu,
)
from kernels.reference import apply_token_bitmask_torch, rms_norm_torch, silu_and_mul_torch

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels cannot be built here"
)

# (rows, hidden): a decode step, a prefill, sizes that leave a tail past the vector width
SHAPES = [(1, 576), (37, 576), (5, 64), (3, 100), (130, 1536)]
# fp32 differs from torch only in summation order; bf16 may round one step apart
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs() / (want.float().abs() + 1e-3)).max().item()
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[1], generator=gen).to(dtype)
    _close(rms_norm_cpu(x, weight, 1e-5)[0], rms_norm_torch(x, weight, 1e-5)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[1], generator=gen).to(dtype)
    want, want_sum = rms_norm_torch(x, weight, 1e-6, residual.clone())
    got, got_sum = rms_norm_cpu(x, weight, 1e-6, residual)
    assert got_sum.data_ptr() == residual.data_ptr()  # the sum is written in place
    assert torch.equal(got_sum, want_sum)  # one rounded add, exactly as torch's
    _close(got, want, dtype)


@pytest.mark.parametrize("stream", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_norm_with_fp32_scale_and_stream_matches_reference(shape, stream):
    """A bf16 model's norms: fp32 scale (``1 + w`` is no bf16 number), the residual stream in
    fp32 or bf16; the normed values scaled in fp32 and rounded once."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    residual = torch.randn(shape, generator=gen).to(stream)
    weight = 1 + torch.randn(shape[1], generator=gen) * 1e-3
    want, want_sum = rms_norm_torch(x, weight, 1e-6, residual.clone())
    got, got_sum = rms_norm_cpu(x, weight, 1e-6, residual)
    assert got_sum.dtype == stream and torch.equal(got_sum, want_sum)
    assert got.dtype == torch.bfloat16
    _close(got, want, torch.bfloat16)
    # One rounding: within half a bf16 ulp of the fp32 product (not two roundings' whole ulp).
    h = want_sum.float()
    exact = weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.all((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-30)


def test_token_bitmask_forbids_exactly_the_clear_bits():
    """Words all set, all clear and mixed; a vocabulary past the mask (forbidden) and one row
    of the logits left alone."""
    gen = torch.Generator().manual_seed(4)
    vocab, words = 1000, 30  # 960 columns covered by the mask, 40 past it
    mask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    mask[0, :10], mask[1, 5:20] = -1, 0
    logits = torch.randn(4, vocab, generator=gen)
    rows = torch.tensor([2, 0, 3])
    want = logits.clone()
    apply_token_bitmask_torch(want, rows, mask)
    apply_token_bitmask_cpu(logits, rows, mask)
    assert torch.equal(logits, want)
    assert torch.isinf(logits[[2, 0, 3], 960:]).all() and not torch.isinf(logits[1]).any()
    bits = ((mask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(3, -1)
    assert torch.equal(torch.isinf(logits[rows, :960]), bits == 0)


def test_rms_norm_reads_strided_rows_and_3d():
    """Rows of a wider buffer (a view) and [T, heads, D] (Qwen3's q/k norm) are read in place."""
    gen = torch.Generator().manual_seed(2)
    buf = torch.randn(9, 200, generator=gen)
    x = buf[:, 8:72]
    weight = torch.randn(64, generator=gen)
    _close(rms_norm(x, weight, 1e-6, backend="cpu")[0], rms_norm_torch(x, weight, 1e-6)[0], fp32)
    x3 = torch.randn(4, 3, 64, generator=gen)
    got = rms_norm(x3, weight, 1e-6, backend="cpu")[0]
    _close(got, rms_norm_torch(x3, weight, 1e-6)[0], fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3072), (33, 3072), (4, 200), (2, 18)])
def test_silu_and_mul_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    x[0, 0], x[0, 1] = -200.0, 200.0  # exp over- and underflow
    _close(silu_and_mul_cpu(x), silu_and_mul_torch(x), dtype)


def test_nan_propagates():
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    normed = rms_norm_cpu(x, torch.ones(64), 1e-6)[0]
    assert torch.isnan(normed[1]).all() and not torch.isnan(normed[0]).any()
    act = silu_and_mul_cpu(torch.cat([x, x], dim=1))
    assert torch.isnan(act[1, 5]) and not torch.isnan(act[0]).any()


def test_torch_backend_uses_reference():
    x = torch.randn(3, 64)
    weight = torch.randn(64)
    assert torch.equal(
        rms_norm(x, weight, 1e-6, backend="torch")[0], rms_norm_torch(x, weight, 1e-6)[0]
    )
    y = torch.randn(3, 128)
    assert torch.equal(silu_and_mul(y, backend="torch"), silu_and_mul_torch(y))


fp32 = torch.float32


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (64, 49152), (5, 33), (2, 100)])
def test_argmax_equals_torch(shape):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen)
    assert torch.equal(argmax_cpu(x), x.argmax(dim=-1))


def test_argmax_ties_nan_inf_and_strided_rows():
    x = torch.zeros(6, 40)
    x[0, [3, 17, 39]] = 5.0  # ties: the first
    x[1, 25] = float("nan")  # NaN outranks everything
    x[1, 30] = float("inf")
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, 39] = 1.0  # in the tail past the last full vector
    x[4, [5, 9]] = float("nan")
    x[5, 20] = float("inf")
    want = torch.tensor([3, 25, 0, 39, 5, 20])
    assert torch.equal(x.argmax(dim=-1), want)
    assert torch.equal(argmax_cpu(x), want)
    wide = torch.randn(4, 80)
    assert torch.equal(argmax(wide[:, 10:70]), wide[:, 10:70].argmax(dim=-1))  # row stride 80
    assert torch.equal(argmax(wide, backend="torch"), wide.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 80), (2, 1, 128)])
def test_rotary_in_place_is_bit_for_bit_the_reference(heads, kv_heads, head_dim, dtype):
    """q and k rotated inside a QKV output (a strided view); v is left alone."""
    from transformers import LlamaConfig

    from engine.models.rotary import RotaryEmbedding
    from kernels import apply_rotary
    from kernels.cpu_attention import rotary_cpu
    from kernels.reference import rotary_apply_torch, rotary_torch

    gen = torch.Generator().manual_seed(7)
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=1e4)
    rope = RotaryEmbedding(config, head_dim, 512)
    positions = torch.randint(0, 512, (37,), generator=gen)
    qkv = (torch.randn(37, heads + 2 * kv_heads, head_dim, generator=gen) * 3).to(dtype)
    qk = qkv[:, : heads + kv_heads]
    cos, signed_sin = rope.cos_sin(positions, dtype)
    expected = rotary_apply_torch(qk, cos, signed_sin)
    hf_q, hf_k = rotary_torch(positions, qk[:, :heads], qk[:, heads:], rope.cos, rope.sin)
    v_before = qkv[:, heads + kv_heads :].clone()

    assert apply_rotary(qk, cos, signed_sin, backend="cpu") is qk  # in place
    assert torch.equal(qk, expected)
    assert torch.equal(qk[:, :heads], hf_q) and torch.equal(qk[:, heads:], hf_k)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)
    with pytest.raises(RuntimeError, match="tokens, 1, dim"):
        rotary_cpu(qk, cos[:5], signed_sin[:5])

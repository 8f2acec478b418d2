"""The Triton quantized linear kernel (run by Triton's interpreter here) equals
``quant_linear_reference``: every weight type with and without zeros, group sizes 32, 128 and
channel-wise, decode and prefill row counts, N off the blocks, fp32 and bf16 x, bias on and off."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.quant_linear import WEIGHT_TYPES, pack_uint4, quant_linear_reference
from kernels.triton_quant_linear import block_config, triton_quant_linear

K = 256
GROUPS = (32, 128, K)
# The other axes cycle through the cases, so each value meets every weight type and zero mode
# without the product (432 interpreter runs).
OTHERS = itertools.cycle(
    [
        (1, 48, torch.float32, True),
        (5, 80, torch.bfloat16, False),
        (33, 48, torch.bfloat16, True),
        (1, 80, torch.bfloat16, True),
        (5, 48, torch.float32, False),
        (33, 80, torch.float32, True),
        (5, 80, torch.bfloat16, True),
    ]
)
CASES = [(*case, *next(OTHERS)) for case in itertools.product(WEIGHT_TYPES, (False, True), GROUPS)]


def make_weight(weight_type, n, k, group_size, with_zeros, rng):
    """A random packed weight whose dequantized values are about ``k ** -0.5``."""
    groups = (n, k // group_size)
    zeros = None
    if weight_type == "float8_e4m3fn":
        qweight = (torch.randn(n, k, generator=rng) * 4).to(torch.float8_e4m3fn)
        scales = (torch.rand(groups, generator=rng) + 0.5) * (4 * k**0.5) ** -1
        if with_zeros:
            zeros = torch.randint(-3, 4, groups, generator=rng).float()
        return qweight, scales, zeros
    top = 16 if weight_type == "uint4" else 256
    q = torch.randint(0, top, (n, k), generator=rng, dtype=torch.uint8)
    qweight = pack_uint4(q) if weight_type == "uint4" else q
    scales = (torch.rand(groups, generator=rng) + 0.5) * (top * k**0.5 / 2) ** -1
    if with_zeros:
        zeros = torch.randint(0, top, groups, generator=rng).float()
    return qweight, scales, zeros


@pytest.mark.parametrize(
    ("weight_type", "with_zeros", "group_size", "m", "n", "dtype", "with_bias"), CASES
)
def test_triton_matches_reference(weight_type, with_zeros, group_size, m, n, dtype, with_bias, rng):
    qweight, scales, zeros = make_weight(weight_type, n, K, group_size, with_zeros, rng)
    x = torch.randn(m, K, generator=rng).to(dtype)
    bias = torch.randn(n, generator=rng).to(dtype) if with_bias else None
    args = (qweight, scales, zeros, weight_type, group_size, bias)
    got = triton_quant_linear(x, *args)
    expected = quant_linear_reference(x, *args)
    assert got.dtype == dtype and got.shape == (m, n)
    # Products are exact and accumulated in fp32 on both sides (only the order differs), so
    # outputs agree to fp32 rounding, or within one bf16 step after the final rounding.
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, expected, rtol=tol, atol=1e-5)
    # Before that rounding: the 16-bit operands (q - zero, x) lose nothing.
    got32 = triton_quant_linear(x, *args, out_dtype=torch.float32)
    expected32 = quant_linear_reference(x.float(), *args)
    torch.testing.assert_close(got32, expected32, rtol=1e-5, atol=1e-5)


def test_fp16_x_and_strided_rows(rng):
    qweight, scales, zeros = make_weight("uint4", 48, K, 64, True, rng)
    x = torch.randn(3, 2 * K, generator=rng).to(torch.float16)[:, :K]  # row stride 2K
    got = triton_quant_linear(x, qweight, scales, zeros, "uint4", 64, out_dtype=torch.float32)
    expected = quant_linear_reference(x.float(), qweight, scales, zeros, "uint4", 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_block_k_divides_group_size():
    for m, group_size in itertools.product((1, 33, 300), (32, 96, 128, 4096)):
        block_k = block_config(m, group_size)[2]
        assert group_size % block_k == 0 and block_k >= 32


def test_rejects_x_of_the_wrong_width(rng):
    qweight, scales, zeros = make_weight("uint8", 48, K, 32, False, rng)
    with pytest.raises(ValueError, match="expected"):
        triton_quant_linear(torch.randn(2, K + 32), qweight, scales, zeros, "uint8", 32)

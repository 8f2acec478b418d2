"""The C++ weight-only quantized linear (kernels/csrc/quant_linear_cpu.cpp) meets
``quant_linear_reference``: every weight type, with and without zero points, per-group and
channel-wise scales, decode and prefill row counts, fp32 and bf16 x, bias, fp32 output of bf16 x,
feature counts off the kernels' blocks; fp8 over all its codes (subnormals, negatives)."""

from __future__ import annotations

import pytest
import torch

from kernels.quant_linear import (
    WEIGHT_TYPE_CODES,
    WEIGHT_TYPES,
    pack_uint4,
    quant_linear,
    quant_linear_cpu_available,
    quant_linear_reference,
)

fp32, bf16 = torch.float32, torch.bfloat16
needs_cpu_kernel = pytest.mark.skipif(
    not quant_linear_cpu_available(), reason="the C++ CPU kernels cannot be built here"
)
FP8_CODES = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=torch.uint8)  # no NaN
MAX_CODE = {"uint4": 15, "uint8": 255}


def make_weight(weight_type, n, k, group_size, with_zeros, gen):
    """A random packed weight: codes over their whole range, positive scales, whole zero points
    (fp8: values 2^-12..2^8 in size, both signs, subnormals included)."""
    groups = k // group_size
    if weight_type == "float8_e4m3fn":
        size = torch.exp2(torch.randint(-12, 9, (n, k), generator=gen).float())
        values = torch.randn(n, k, generator=gen) * size
        qweight = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        zeros = torch.randint(-2, 3, (n, groups), generator=gen).float() if with_zeros else None
    else:
        top = MAX_CODE[weight_type]
        codes = torch.randint(0, top + 1, (n, k), generator=gen)
        qweight = pack_uint4(codes) if weight_type == "uint4" else codes.to(torch.uint8)
        zeros = torch.randint(0, top + 1, (n, groups), generator=gen).float()
        zeros = zeros if with_zeros else None
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    return qweight, scales, zeros


def run_kernel(x, qweight, scales, zeros, weight_type, group_size, bias, out_dtype):
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=out_dtype)
    code = WEIGHT_TYPE_CODES[weight_type]
    torch.ops.pagedq.quant_linear(x, qweight, scales, zeros, code, group_size, bias, out)
    return out


def check(out, ref):
    """fp32: to 1e-5 of the output's scale; bf16: the reference rounded once (one bf16 step)."""
    scale = ref.abs().max().item()
    rtol = 1e-5 if out.dtype == fp32 else 2**-8
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-5 * scale)


# (tokens, out_features): one decode row and a few, 16 (the decode kernels' most), 17 and more
# (prefill tiles), with feature counts that are not multiples of 16 or 64.
ROWS = [(1, 72), (3, 200), (16, 72), (17, 200), (64, 72), (130, 200)]


@needs_cpu_kernel
@pytest.mark.parametrize("x_dtype", [fp32, bf16])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])  # 256: channel-wise (in_features)
@pytest.mark.parametrize("with_zeros", [False, True])
@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_matches_reference(weight_type, with_zeros, group_size, x_dtype, rng):
    k = 256
    x = torch.randn(max(t for t, _ in ROWS), k, generator=rng).to(x_dtype)
    for n in {n for _, n in ROWS}:
        qweight, scales, zeros = make_weight(weight_type, n, k, group_size, with_zeros, rng)
        bias = torch.randn(n, generator=rng)
        ref = quant_linear_reference(x.float(), qweight, scales, zeros, weight_type, group_size)
        for tokens in (t for t, rows_n in ROWS if rows_n == n):
            with_bias = tokens % 2 == 1
            for out_dtype in {x_dtype, fp32}:
                out = run_kernel(
                    x[:tokens], qweight, scales, zeros, weight_type, group_size,
                    bias if with_bias else None, out_dtype,
                )  # fmt: skip
                check(out, ref[:tokens] + bias if with_bias else ref[:tokens])


@needs_cpu_kernel
@pytest.mark.parametrize("x_dtype", [fp32, bf16])
@pytest.mark.parametrize("weight_type", ["uint4", "uint8"])
@pytest.mark.parametrize("group_size", [128, 4096])
def test_long_rows_extreme_codes(weight_type, group_size, x_dtype, rng):
    """in_features 4096: k in chunks, channel-wise groups in parts; codes and zero points at both
    ends of their range; x rows strided."""
    k, top = 4096, MAX_CODE[weight_type]
    for tokens in (1, 7, 16, 33):
        qweight, scales, zeros = make_weight(weight_type, 40, k, group_size, True, rng)
        codes = torch.randint(0, top + 1, (40, k), generator=rng)
        codes[:, :64], codes[:, 64:128] = top, 0
        qweight = pack_uint4(codes) if weight_type == "uint4" else codes.to(torch.uint8)
        zeros[0], zeros[-1] = 0, top
        x = torch.randn(tokens, k + 64, generator=rng).to(x_dtype)[:, 32 : 32 + k]
        ref = quant_linear_reference(x.float(), qweight, scales, zeros, weight_type, group_size)
        check(run_kernel(x, qweight, scales, zeros, weight_type, group_size, None, x_dtype), ref)


@needs_cpu_kernel
@pytest.mark.parametrize("x_dtype", [fp32, bf16])
@pytest.mark.parametrize("with_zeros", [False, True])
def test_every_fp8_code(with_zeros, x_dtype, rng):
    """Each e4m3 code but NaN, in every row at shifting positions: subnormals, zeros of both
    signs, the largest magnitudes."""
    k, group_size = 512, 32
    for tokens, n in ((1, 40), (16, 33), (40, 72)):
        index = (torch.arange(n)[:, None] * 7 + torch.arange(k)) % len(FP8_CODES)
        qweight = FP8_CODES[index].view(torch.float8_e4m3fn)
        scales = torch.rand(n, k // group_size, generator=rng) + 0.5
        zeros = torch.randint(-2, 3, scales.shape, generator=rng).float() if with_zeros else None
        x = torch.randn(tokens, k, generator=rng).to(x_dtype)
        ref = quant_linear_reference(x.float(), qweight, scales, zeros, "float8_e4m3fn", group_size)
        out = run_kernel(x, qweight, scales, zeros, "float8_e4m3fn", group_size, None, x_dtype)
        check(out, ref)


@needs_cpu_kernel
def test_rejects_what_the_layout_does_not_allow(rng):
    qweight, scales, zeros = make_weight("uint4", 64, 256, 64, True, rng)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="weight_type"):
        torch.ops.pagedq.quant_linear(x, qweight, scales, zeros, 7, 64, None, torch.empty(2, 64))
    with pytest.raises(RuntimeError, match="qweight"):
        run_kernel(x, qweight, scales, zeros, "uint8", 64, None, fp32)
    with pytest.raises(RuntimeError, match="scales"):
        run_kernel(x, qweight, scales[:, :2].contiguous(), None, "uint4", 64, None, fp32)


@pytest.mark.parametrize("x_dtype", [fp32, bf16])
def test_dispatcher_takes_any_leading_dims(x_dtype, rng):
    """``quant_linear`` (C++ kernel here, the reference where it is not built) over [2, 3, K] x,
    the output rounded once to out_dtype."""
    qweight, scales, zeros = make_weight("uint4", 72, 128, 32, True, rng)
    x = torch.randn(2, 3, 128, generator=rng).to(x_dtype)
    bias = torch.randn(72, generator=rng)
    ref = quant_linear_reference(x.float(), qweight, scales, zeros, "uint4", 32, bias)
    for out_dtype in (None, fp32):
        out = quant_linear(x, qweight, scales, zeros, "uint4", 32, bias, out_dtype)
        assert out.shape == (2, 3, 72) and out.dtype == (out_dtype or x_dtype)
        check(out.reshape(6, 72), ref.reshape(6, 72))

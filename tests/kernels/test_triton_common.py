"""The interpreter workarounds reproduce GPU numerics."""

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast, dot, interpreting


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, cast(tl.load(x_ptr + offs), y_ptr.dtype.element_ty, INTERPRET))


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, N)
    grid = offs[:, None] * N + offs[None, :]
    c = dot(tl.load(a_ptr + grid), tl.load(b_ptr + grid), "ieee", INTERPRET)
    tl.store(c_ptr + grid, c)


def test_tests_run_on_the_interpreter():
    assert interpreting()


def test_cast_to_bf16_rounds_to_nearest_even():
    x = torch.randn(1024) * 100
    # Values exactly halfway between two bf16 numbers: ties go to the even mantissa.
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 255.5])
    y = torch.empty(1024, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, N=1024, INTERPRET=interpreting())
    assert torch.equal(y, x.to(torch.bfloat16))


def test_bf16_dot_accumulates_exactly_in_fp32():
    a, b = torch.randn(2, 16, 16).to(torch.bfloat16)
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, N=16, INTERPRET=interpreting())
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-6, atol=1e-6)

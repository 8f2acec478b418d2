"""Cases the recurrent-state kernel tests share (test_gated_delta, test_kimi_delta,
test_mamba_ssm): the forms each runs, and the checks whose shape is the same for every kernel.

A kernel is called as ``form(*tensors, state_pool, query_start_loc, state_indices, ...)``:
``tensors`` are its inputs before the pool, in its own order.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from kernels import triton_available
from kernels.cpu_attention import cpu_kernels_available

needs_cpu = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ kernels here")
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
BACKEND_MARKS = {"cpu": needs_cpu, "triton": needs_triton}


def loc(lens: list[int]) -> torch.Tensor:
    """``query_start_loc`` (int32) of sequences of ``lens`` tokens."""
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def forms(
    recurrent: Callable, chunked: Callable, dispatch: Callable
) -> tuple[dict[str, Callable], list]:
    """``(FORMS, NAMES)``: the two reference forms and the dispatcher on each backend, and their
    names to parametrize over (the C++ and Triton ones skipped where not built or installed)."""
    table = {"recurrent": recurrent, "chunked": chunked}
    table |= {b: partial(dispatch, backend=b) for b in ("torch", "cpu", "triton")}
    names = [pytest.param(n, marks=BACKEND_MARKS[n]) if n in BACKEND_MARKS else n for n in table]
    return table, names


def backends() -> list:
    """The kernel backends to parametrize over: C++ and Triton."""
    return [pytest.param(b, marks=mark) for b, mark in BACKEND_MARKS.items()]


def assert_split_equals_one_pass(
    form: Callable, rows: Callable[[int, int], tuple], pool: torch.Tensor, cuts: list[int],
    atol: float, rtol: float = 0.0,
) -> None:  # fmt: skip
    """A prompt cut at ``cuts`` (``rows(a, b)``: the kernel's tensors for rows ``a:b``) carries
    its state in slot 2 from call to call and equals one pass; the first call starts from zero
    whatever the slot held."""
    n, slot = cuts[-1], torch.tensor([2])
    whole_pool = pool.clone()
    whole = form(*rows(0, n), whole_pool, loc([n]), slot, has_initial_state=torch.tensor([False]))
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        part = form(*rows(a, b), pool, loc([b - a]), slot,
                    has_initial_state=torch.tensor([i > 0]))  # fmt: skip
        torch.testing.assert_close(part, whole[a:b], atol=atol, rtol=rtol)
    torch.testing.assert_close(pool, whole_pool, atol=atol, rtol=rtol)


def assert_decode_batch(
    form: Callable, reference: Callable, tensors: tuple, pool: torch.Tensor, rtol: float = 0.0,
    **kwargs,
) -> torch.Tensor:  # fmt: skip
    """One token for each of four sequences (the decode step), slots out of order: ``form``
    equals ``reference`` in outputs and states (1e-5). Returns ``form``'s output."""
    slots = torch.tensor([3, 0, 4, 1])
    want_pool = pool.clone()
    want = reference(*tensors, want_pool, loc([1] * 4), slots)
    got = form(*tensors, pool, loc([1] * 4), slots, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=rtol)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=rtol)
    return got


def assert_bf16_matches_reference(
    dispatch: Callable, reference: Callable, tensors: tuple, pool: torch.Tensor, lens: list[int],
    backend: str, pool_rtol: float = 0.0,
) -> None:  # fmt: skip
    """bf16 inputs with the fp32 state on ``backend``: the output is bf16 and equals the
    reference on the same inputs up to bf16 rounding; the states agree to fp32 rounding."""
    slots = torch.arange(1, len(lens) + 1)
    want_pool = pool.clone()
    want = reference(*tensors, want_pool, loc(lens), slots)
    got = dispatch(*tensors, pool, loc(lens), slots, backend=backend)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=pool_rtol)

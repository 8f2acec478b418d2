"""The gated delta rule and its causal conv1d: recurrent == chunked == transformers' functions;
a sequence split at any chunk boundaries equals one pass; varlen batches with state slots;
the C++ and Triton (interpreter) kernels against the reference."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_torch,
    causal_conv1d_update_torch,
)
from kernels.gated_delta import (
    gated_delta_rule,
    gated_delta_rule_chunked_torch,
    gated_delta_rule_recurrent_torch,
    gdn_gating,
)
from tests.kernels.recurrent_cases import (
    assert_bf16_matches_reference,
    assert_decode_batch,
    assert_split_equals_one_pass,
    backends,
    forms,
    loc,
    needs_cpu,
)

NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8  # two value heads per key head, as Qwen3.5


def _inputs(rng, num_tokens, dtype=torch.float32, num_slots=5):
    """q, k, v, g, beta of a varlen batch, and a pool of random states (slot 0 spare)."""
    q = torch.randn(num_tokens, NUM_K_HEADS, K_DIM, generator=rng)
    k = torch.randn(num_tokens, NUM_K_HEADS, K_DIM, generator=rng)
    v = torch.randn(num_tokens, NUM_V_HEADS, V_DIM, generator=rng)
    a, b = torch.randn(2, num_tokens, NUM_V_HEADS, generator=rng)
    A_log = torch.rand(NUM_V_HEADS, generator=rng).mul(16).clamp_min(0.01).log()
    g, beta = gdn_gating(a, b, A_log, torch.ones(NUM_V_HEADS))
    pool = torch.randn(num_slots, NUM_V_HEADS, K_DIM, V_DIM, generator=rng) * 0.3
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, pool


FORMS, NAMES = forms(
    gated_delta_rule_recurrent_torch, gated_delta_rule_chunked_torch, gated_delta_rule
)


@pytest.mark.parametrize("name", NAMES)
def test_forms_match_transformers(rng, name):
    """One sequence of 80 tokens (two chunks, the last partial) from a non-zero state; 24 on
    Triton's interpreter (slow per token; the kernel has one form for every length)."""
    n = 24 if name == "triton" else 80
    q, k, v, g, beta, pool = _inputs(rng, n)
    batch = [x[None] for x in (q, k, v, g, beta)]
    kwargs = dict(initial_state=pool[3:4].clone(), output_final_state=True)
    want_c, state_c = torch_chunk_gated_delta_rule(*batch, **kwargs, use_qk_l2norm_in_kernel=True)
    want_r, state_r = torch_recurrent_gated_delta_rule(
        *batch, **kwargs, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(want_c, want_r, atol=1e-5, rtol=0)  # transformers' two agree
    got = FORMS[name](q, k, v, g, beta, pool, loc([n]), torch.tensor([3]))
    torch.testing.assert_close(got, want_c[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(pool[3], state_c[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_split_over_steps_equals_one_pass(rng, name):
    """A prompt cut at arbitrary points (inside and across chunks, single tokens) carries its
    state from call to call and equals one pass; a first call without an initial state starts
    from zero whatever the slot held. (Triton's interpreter takes a shorter prompt: its kernel
    has one form for every length.)"""
    cuts = [0, 1, 9, 10, 23, 24] if name == "triton" else [0, 1, 37, 38, 70, 99, 100]
    *tensors, pool = _inputs(rng, cuts[-1])
    assert_split_equals_one_pass(
        FORMS[name], lambda a, b: [t[a:b] for t in tensors], pool, cuts, atol=2e-5
    )


@pytest.mark.parametrize("name", NAMES)
def test_varlen_batch_with_slots(rng, name):
    """A prefill chunk, decodes and an empty sequence in one call, each on its own slot, equal
    each sequence run alone; slots nobody names stay as they were."""
    lens, slots = [70, 1, 0, 5, 1], [4, 1, 0, 3, 2]
    q, k, v, g, beta, pool = _inputs(rng, sum(lens), num_slots=7)
    fresh = torch.tensor([True, True, True, False, True])
    before = pool.clone()
    got = FORMS[name](
        q, k, v, g, beta, pool, loc(lens), torch.tensor(slots), has_initial_state=fresh
    )
    starts = loc(lens).tolist()
    alone_pool = before.clone()
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        if a == b:
            continue
        want = gated_delta_rule_recurrent_torch(
            q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], alone_pool, loc([b - a]),
            torch.tensor([slots[i]]), has_initial_state=fresh[i : i + 1].clone(),
        )  # fmt: skip
        torch.testing.assert_close(got[a:b], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool, alone_pool, atol=1e-5, rtol=0)
    assert torch.equal(pool[[0, 5, 6]], before[[0, 5, 6]])


@pytest.mark.parametrize("name", NAMES)
def test_decode_batch(rng, name):
    """One token for each of four sequences (the decode step), slots out of order."""
    *tensors, pool = _inputs(rng, 4)
    assert_decode_batch(FORMS[name], gated_delta_rule_chunked_torch, tensors, pool)


def test_fp32_forms_against_float64(rng):
    """The float64 reference is the oracle: both fp32 forms stay within 1e-5 of it."""
    q, k, v, g, beta, pool = _inputs(rng, 200)
    starts, slot = loc([200]), torch.tensor([1])
    pool64 = pool.double()
    want = gated_delta_rule_chunked_torch(q.double(), k.double(), v.double(), g.double(),
                                          beta.double(), pool64, starts, slot)  # fmt: skip
    for form in (gated_delta_rule_recurrent_torch, gated_delta_rule_chunked_torch):
        p = pool.clone()
        got = form(q, k, v, g, beta, p, starts, slot)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(p.double(), pool64, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", backends())
def test_bf16_inputs(rng, backend):
    """bf16 q/k/v with the fp32 state: the kernel equals the reference up to bf16 rounding of
    the output."""
    lens = [33, 1, 1]
    q, k, v, g, beta, pool = _inputs(rng, sum(lens), dtype=torch.bfloat16)
    tensors = (q, k, v, g, beta.bfloat16())
    assert_bf16_matches_reference(
        gated_delta_rule, gated_delta_rule_chunked_torch, tensors, pool, lens, backend
    )


def test_bad_shapes_are_named(rng):
    q, k, v, g, beta, pool = _inputs(rng, 4)
    with pytest.raises(ValueError, match="state_pool"):
        gated_delta_rule(q, k, v, g, beta, pool[:, :2], loc([4]), torch.tensor([0]))
    with pytest.raises(ValueError, match="g .* beta"):
        gated_delta_rule(q, k, v, g[:, :1], beta, pool, loc([4]), torch.tensor([0]))


# --- the causal conv1d ---------------------------------------------------------------------

DIM, KERNEL = 80, 4  # 80 channels: one full block of 64 and a tail
CONV_FORMS = {
    "torch": "torch",
    "cpu": pytest.param("cpu", marks=needs_cpu),
    "triton": "triton",
}


def _conv_inputs(rng, num_tokens, dtype, num_slots=4):
    x = torch.randn(num_tokens, DIM, generator=rng).to(dtype)
    weight = torch.randn(DIM, KERNEL, generator=rng).mul(0.5).to(dtype)
    bias = torch.randn(DIM, generator=rng).to(dtype)
    pool = torch.randn(num_slots, DIM, KERNEL - 1, generator=rng).to(dtype)
    return x, weight, bias, pool


def _conv_close(got, want):
    tol = 1e-6 if got.dtype == torch.float32 else 1e-2  # bf16: one rounding step apart at most
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CONV_FORMS.values(), ids=CONV_FORMS.keys())
def test_conv_matches_transformers_and_carries_state(rng, backend, dtype):
    """A fresh prompt equals transformers' causal_conv1d_fn; the same prompt cut into a 2-token
    chunk, a decode token and the rest equals it too, and the decode equals
    causal_conv1d_update."""
    x, weight, bias, pool = _conv_inputs(rng, 12, dtype)
    want = causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")[0].t()
    fresh = torch.tensor([False])
    got = causal_conv1d(x, weight, bias, pool, loc([12]), torch.tensor([1]), fresh,
                        backend=backend)  # fmt: skip
    _conv_close(got, want)
    final = pool[1].clone()
    first = causal_conv1d(x[:2], weight, bias, pool, loc([2]), torch.tensor([2]), fresh,
                          backend=backend)  # fmt: skip
    hf_state = torch.cat([torch.zeros(1, DIM, 1, dtype=dtype), pool[2:3]], dim=2)
    want_decode = causal_conv1d_update(x[2:3, :, None], hf_state, weight, bias, "silu")[:, :, 0]
    from kernels.causal_conv1d import causal_conv1d_update as update

    decode = update(x[2:3], weight, bias, pool, torch.tensor([2]), backend=backend)
    _conv_close(decode, want_decode)
    rest = causal_conv1d(x[3:], weight, bias, pool, loc([9]), torch.tensor([2]),
                         backend=backend)  # fmt: skip
    _conv_close(torch.cat([first, decode, rest]), want)
    _conv_close(pool[2], final)


@pytest.mark.parametrize("backend", CONV_FORMS.values(), ids=CONV_FORMS.keys())
def test_conv_varlen_batch(rng, backend):
    """Sequences shorter than the kernel, decodes and an empty one, with and without initial
    state, in one call: each equals the reference; the unnamed slot is untouched."""
    lens, slots = [2, 1, 0, 7, 1], [3, 0, 5, 4, 1]
    x, weight, bias, pool = _conv_inputs(rng, sum(lens), torch.float32, num_slots=6)
    fresh = torch.tensor([False, True, True, True, False])
    want_pool = pool.clone()
    want = causal_conv1d_torch(x, weight, None, want_pool, loc(lens), torch.tensor(slots), fresh)
    got = causal_conv1d(x, weight, None, pool, loc(lens), torch.tensor(slots), fresh,
                        backend=backend)  # fmt: skip
    _conv_close(got, want)
    _conv_close(pool, want_pool)
    assert torch.equal(pool[2], want_pool[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CONV_FORMS.values(), ids=CONV_FORMS.keys())
def test_conv_without_activation_matches_transformers(rng, backend, dtype):
    """``activation=None`` (LFM2's short convolution): a prompt in two chunks equals
    transformers' convolution with no activation, and the pool its last inputs."""
    x, weight, bias, pool = _conv_inputs(rng, 10, dtype)
    want = causal_conv1d_fn(x.t()[None], weight, bias, activation=None)[0].t()
    first = causal_conv1d(x[:3], weight, bias, pool, loc([3]), torch.tensor([1]),
                          torch.tensor([False]), None, backend=backend)  # fmt: skip
    rest = causal_conv1d(x[3:], weight, bias, pool, loc([7]), torch.tensor([1]),
                         torch.tensor([True]), None, backend=backend)  # fmt: skip
    _conv_close(torch.cat([first, rest]), want)
    assert torch.equal(pool[1], x[-(KERNEL - 1) :].t())


def test_conv_update_reference_is_the_varlen_reference(rng):
    x, weight, bias, pool = _conv_inputs(rng, 3, torch.float32)
    other = pool.clone()
    a = causal_conv1d_update_torch(x, weight, bias, pool, torch.tensor([2, 0, 3]))
    b = causal_conv1d_torch(x, weight, bias, other, loc([1, 1, 1]), torch.tensor([2, 0, 3]))
    _conv_close(a, b)
    _conv_close(pool, other)

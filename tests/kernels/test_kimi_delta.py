"""Kimi Delta Attention: recurrent == chunked == a plain float64 loop == transformers' functions;
a prompt split over calls equals one pass; varlen batches with state slots; the C++ and Triton
(interpreter) kernels against the reference; with no decay it is the gated delta rule."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from kernels.gated_delta import gated_delta_rule_torch
from kernels.kimi_delta import (
    kimi_delta_rule,
    kimi_delta_rule_chunked_torch,
    kimi_delta_rule_recurrent_torch,
)
from tests.kernels.recurrent_cases import (
    assert_bf16_matches_reference,
    assert_decode_batch,
    assert_split_equals_one_pass,
    backends,
    forms,
    loc,
)

# k_dim 12 (not a power of two) exercises the kernels' masks; v_dim != k_dim catches a swap.
NUM_HEADS, K_DIM, V_DIM = 2, 12, 8


def _inputs(rng, num_tokens, dtype=torch.float32, num_slots=5):
    """q, k, v, g, beta of a varlen batch (g as Kimi Linear's forget gate computes it), and a
    pool of random states."""
    q = torch.randn(num_tokens, NUM_HEADS, K_DIM, generator=rng)
    k = torch.randn(num_tokens, NUM_HEADS, K_DIM, generator=rng)
    v = torch.randn(num_tokens, NUM_HEADS, V_DIM, generator=rng)
    a = torch.randn(num_tokens, NUM_HEADS, K_DIM, generator=rng) - 2
    A_log = torch.rand(NUM_HEADS, 1, generator=rng).mul(15).add(1).log()  # exp(A_log) in [1, 16]
    g = -A_log.exp() * F.softplus(a)
    beta = torch.rand(num_tokens, NUM_HEADS, generator=rng)
    pool = torch.randn(num_slots, NUM_HEADS, K_DIM, V_DIM, generator=rng) * 0.3
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, pool


def _naive(q, k, v, g, beta, state, scale=K_DIM**-0.5):
    """One sequence, float64, one head and one token at a time, straight from the definition."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() * scale
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    s = s.clone()
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s[h] = g[t, h].exp()[:, None] * s[h]
            s[h] += torch.outer(k[t, h], beta[t, h] * (v[t, h] - k[t, h] @ s[h]))
            out[t, h] = q[t, h] @ s[h]
    return out, s


FORMS, NAMES = forms(
    kimi_delta_rule_recurrent_torch, kimi_delta_rule_chunked_torch, kimi_delta_rule
)


@pytest.mark.parametrize("name", NAMES)
def test_varlen_batch_matches_float64_loop(rng, name):
    """Empty, one-token and multi-chunk sequences in one call, some from their slot's state and
    some from zero: each equals the float64 loop; slots nobody names stay as they were.
    (Triton's interpreter is slow per token: 40 tokens still span three of its chunks.)"""
    long = 40 if name == "triton" else 150
    lens, slots = [long, 1, 0, 5, 1], [4, 1, 0, 3, 2]
    fresh = torch.tensor([True, False, True, True, False])
    q, k, v, g, beta, pool = _inputs(rng, sum(lens), num_slots=7)
    before = pool.clone()
    got = FORMS[name](q, k, v, g, beta, pool, loc(lens), torch.tensor(slots),
                      has_initial_state=~fresh)  # fmt: skip
    starts = loc(lens).tolist()
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        initial = torch.zeros_like(before[0]) if fresh[i] else before[slots[i]]
        want, state = _naive(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial)
        torch.testing.assert_close(got[a:b].double(), want, atol=1e-5, rtol=0)
        if a < b:
            torch.testing.assert_close(pool[slots[i]].double(), state, atol=1e-5, rtol=0)
    assert torch.equal(pool[[0, 5, 6]], before[[0, 5, 6]])  # slot 0: the empty sequence's


@pytest.mark.parametrize("name", NAMES)
def test_matches_transformers(rng, name):
    """One sequence of 80 tokens (two chunks, the last partial) from a non-zero state against
    transformers' torch ``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention``."""
    n = 24 if name == "triton" else 80
    q, k, v, g, beta, pool = _inputs(rng, n)
    batch = [x[None] for x in (q, k, v, g, beta)]
    kwargs = dict(initial_state=pool[3:4].clone(), output_final_state=True)
    want_c, state_c = chunk_kimi_delta_attention(*batch, **kwargs, use_qk_l2norm_in_kernel=True)
    want_r, state_r = recurrent_kimi_delta_attention(*batch, **kwargs, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(want_c, want_r, atol=1e-5, rtol=0)  # transformers' two agree
    got = FORMS[name](q, k, v, g, beta, pool, loc([n]), torch.tensor([3]))
    torch.testing.assert_close(got, want_c[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(pool[3], state_c[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_split_over_steps_equals_one_pass(rng, name):
    """A prompt cut inside and across chunks and into single tokens carries its state from call
    to call and equals one pass; the first call starts from zero whatever the slot held."""
    cuts = [0, 1, 9, 10, 23, 24] if name == "triton" else [0, 1, 37, 38, 70, 99, 100]
    *tensors, pool = _inputs(rng, cuts[-1])
    assert_split_equals_one_pass(
        FORMS[name], lambda a, b: [t[a:b] for t in tensors], pool, cuts, atol=2e-5
    )


@pytest.mark.parametrize("name", NAMES)
def test_decode_batch(rng, name):
    """One token for each of four sequences (the decode step), slots out of order."""
    *tensors, pool = _inputs(rng, 4)
    assert_decode_batch(FORMS[name], kimi_delta_rule_chunked_torch, tensors, pool)


@pytest.mark.parametrize("name", ["recurrent", "chunked"])
def test_float64_pool_computes_in_float64(rng, name):
    """A float64 pool (the checks' oracle) makes the reference compute in float64."""
    q, k, v, g, beta, pool = (x.double() for x in _inputs(rng, 70))
    want, state = _naive(q, k, v, g, beta, pool[1])
    got = FORMS[name](q, k, v, g, beta, pool, loc([70]), torch.tensor([1]))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(pool[1], state, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["chunked", "triton"])
def test_strong_decay_stays_finite(rng, name):
    """Channels that decay by exp(-60) a token (a chunk's total far past fp32's exp range) give
    the recurrent result, not inf or NaN: the chunked forms never exponentiate a growth."""
    q, k, v, g, beta, pool = _inputs(rng, 40)
    g[:, :, : K_DIM // 2] = -60.0
    want_pool = pool.clone()
    want = kimi_delta_rule_recurrent_torch(q, k, v, g, beta, want_pool, loc([40]),
                                           torch.tensor([1]))  # fmt: skip
    got = FORMS[name](q, k, v, g, beta, pool, loc([40]), torch.tensor([1]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=0)


def test_without_decay_is_the_gated_delta_rule(rng):
    """g = 0 (no forgetting) on every channel is the gated delta rule with g = 0."""
    lens = [70, 1, 3]
    q, k, v, _, beta, pool = _inputs(rng, sum(lens))
    kda_pool, gdn_pool = pool.clone(), pool.clone()
    args = (loc(lens), torch.tensor([1, 2, 3]))
    got = kimi_delta_rule_chunked_torch(q, k, v, torch.zeros_like(q), beta, kda_pool, *args)
    want = gated_delta_rule_torch(q, k, v, torch.zeros_like(beta), beta, gdn_pool, *args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(kda_pool, gdn_pool, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", backends())
def test_bf16_inputs(rng, backend):
    """bf16 q/k/v with the fp32 state: the kernel equals the reference up to bf16 rounding of
    the output."""
    lens = [33, 1, 1]
    q, k, v, g, beta, pool = _inputs(rng, sum(lens), dtype=torch.bfloat16)
    tensors = (q, k, v, g, beta.bfloat16())
    assert_bf16_matches_reference(
        kimi_delta_rule, kimi_delta_rule_chunked_torch, tensors, pool, lens, backend
    )


def test_auto_backend_on_cpu_matches_reference(rng):
    """The dispatcher's own pick on CPU tensors (C++ where built, else the reference)."""
    q, k, v, g, beta, pool = _inputs(rng, 20)
    want_pool = pool.clone()
    want = kimi_delta_rule_recurrent_torch(q, k, v, g, beta, want_pool, loc([20]),
                                           torch.tensor([0]))  # fmt: skip
    got = kimi_delta_rule(q, k, v, g, beta, pool, loc([20]), torch.tensor([0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda q, k, v, g, beta, pool: (q, k[:, :, :4], v, g, beta, pool), "^k "),
        (lambda q, k, v, g, beta, pool: (q, k, v[:, :1], g, beta, pool), "^v "),
        (lambda q, k, v, g, beta, pool: (q, k, v, g[:, :, 0], beta, pool), "^g "),
        (lambda q, k, v, g, beta, pool: (q, k, v, g, beta[:, :, None], pool), "^beta "),
        (lambda q, k, v, g, beta, pool: (q, k, v, g, beta, pool[:, :, :, :4]), "^state_pool "),
    ],
    ids=["k", "v", "g", "beta", "state_pool"],
)
def test_bad_shapes_are_named(rng, bad, match):
    q, k, v, g, beta, pool = _inputs(rng, 4)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=match):
            kimi_delta_rule(*bad(q, k, v, g, beta, pool), loc([4]), torch.tensor([0]),
                            backend=backend)  # fmt: skip
    with pytest.raises(ValueError, match="state_indices"):
        kimi_delta_rule(q, k, v, g, beta, pool, loc([4]), torch.tensor([0, 1]), backend="torch")

"""The Mamba-2 scan: recurrent == chunked == a plain float64 loop == transformers' functions; a
prompt split over calls equals one pass; varlen batches with state slots; the C++ and Triton
(interpreter) kernels against the reference; the dispatch and the argument checks. Mamba-1's
selective scan (a decay per state dimension) and MiniMax's lightning attention (a unit step) on
every backend against float64 loops of their own."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)

import kernels.mamba_ssm as mamba_ssm
from kernels.mamba_ssm import (
    lightning_attention,
    mamba_chunk_scan,
    mamba_chunk_scan_chunked_torch,
    mamba_chunk_scan_recurrent_torch,
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

HEADS, HEAD_DIM, STATE_DIM = 4, 8, 20  # 20: a full vector of the C++ loop and a tail
FORMS, NAMES = forms(
    mamba_chunk_scan_recurrent_torch, mamba_chunk_scan_chunked_torch, mamba_chunk_scan
)


def _inputs(rng, num_tokens, num_groups=2, extras=True, dtype=torch.float32, num_slots=5):
    """x, dt, A, B, C, D, dt_bias of a varlen batch, and a pool of random states. x is a view
    with unit stride last only (as a split of the input projection gives)."""
    x = torch.randn(num_tokens, HEADS, 2 * HEAD_DIM, generator=rng)[..., :HEAD_DIM]
    dt = torch.randn(num_tokens, HEADS, generator=rng) - 1.0
    A = -torch.rand(HEADS, generator=rng).mul(4).add(0.1)
    B, C = torch.randn(2, num_tokens, num_groups, STATE_DIM, generator=rng).mul(0.5)
    D = torch.randn(HEADS, generator=rng) if extras else None
    dt_bias = torch.randn(HEADS, generator=rng) if extras else None
    pool = torch.randn(num_slots, HEADS, HEAD_DIM, STATE_DIM, generator=rng) * 0.3
    return x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype), D, dt_bias, pool


def _naive(x, dt, A, B, C, D, dt_bias, pool, lens, slots, has_initial, dt_limit):
    """Sequence by sequence, token by token, head by head, in float64: the oracle."""
    x, dt, A, B, C, pool = (t.double() for t in (x, dt, A, B, C, pool))
    heads = x.shape[1]
    D = torch.zeros(heads) if D is None else D
    dt_bias = torch.zeros(heads) if dt_bias is None else dt_bias
    out, t = torch.zeros_like(x), 0
    heads_per_group = heads // B.shape[1]
    for i, n in enumerate(lens):
        for h in range(heads):
            g = h // heads_per_group
            state = pool[slots[i], h].clone() if has_initial[i] else torch.zeros_like(pool[0, 0])
            for r in range(t, t + n):
                d = F.softplus(dt[r, h] + dt_bias[h]).clamp(*dt_limit)
                # A[h]: one decay, or one per state dimension (Mamba-1)
                state = torch.exp(d * A[h]) * state + d * torch.outer(x[r, h], B[r, g])
                out[r, h] = state @ C[r, g] + D[h] * x[r, h]
            if n:
                pool[slots[i], h] = state
        t += n
    return out, pool


CASES = {
    "one-group-plain": dict(num_groups=1, extras=False, dt_limit=(0.0, float("inf"))),
    "two-groups-D-bias-limit": dict(num_groups=2, extras=True, dt_limit=(0.05, 0.8)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", NAMES)
def test_varlen_batch_matches_float64_loop(rng, name, case):
    """A long prefill chunk (past two chunks, the last partial), decodes and an empty sequence
    in one call, fresh and continued, each on its own slot: outputs and written-back states
    equal the float64 loop; unnamed slots and the empty sequence's slot stay as they were."""
    opts = CASES[case]
    lens = [130, 1, 0, 5, 1]
    slots = [4, 1, 0, 3, 2]
    fresh = torch.tensor([True, False, True, False, True])
    x, dt, A, B, C, D, dt_bias, pool = _inputs(
        rng, sum(lens), opts["num_groups"], opts["extras"], num_slots=7
    )
    want, want_pool = _naive(x, dt, A, B, C, D, dt_bias, pool, lens, slots, fresh,
                             opts["dt_limit"])  # fmt: skip
    before = pool.clone()
    got = FORMS[name](x, dt, A, B, C, D, dt_bias, pool, loc(lens), torch.tensor(slots),
                      has_initial_state=fresh, dt_limit=opts["dt_limit"])  # fmt: skip
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.double(), want_pool, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[0, 5, 6]], before[[0, 5, 6]])


def _selective_inputs(rng, num_tokens, channels=12, dtype=torch.float32, num_slots=7):
    """Mamba-1's scan as this kernel takes it: a head per channel (``head_dim`` 1), one group,
    ``A`` ``[channels, state_dim]``."""
    x = torch.randn(num_tokens, channels, 1, generator=rng)
    dt = torch.randn(num_tokens, channels, generator=rng) - 1.0
    A = -torch.rand(channels, STATE_DIM, generator=rng).mul(4).add(0.1)
    B, C = torch.randn(2, num_tokens, 1, STATE_DIM, generator=rng).mul(0.5)
    D, dt_bias = torch.randn(2, channels, generator=rng)
    pool = torch.randn(num_slots, channels, 1, STATE_DIM, generator=rng) * 0.3
    return x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D, dt_bias, pool


@pytest.mark.parametrize("name", [n for n in NAMES if getattr(n, "values", (n,))[0] != "chunked"])
def test_a_decay_per_state_dimension_matches_float64_loop(rng, name):
    """Mamba-1's selective scan (``A`` ``[heads, state_dim]``): a prefill chunk, decodes and an
    empty sequence in one call equal the float64 loop, outputs and written-back states; split
    over calls it equals one pass."""
    lens, slots = [45, 1, 0, 6], [4, 1, 0, 3]
    fresh = torch.tensor([True, False, True, False])
    x, dt, A, B, C, D, dt_bias, pool = _selective_inputs(rng, sum(lens))
    want, want_pool = _naive(x, dt, A, B, C, D, dt_bias, pool, lens, slots, fresh, (0.0, 9.0))
    got = FORMS[name](x, dt, A, B, C, D, dt_bias, pool, loc(lens), torch.tensor(slots),
                      has_initial_state=fresh, dt_limit=(0.0, 9.0))  # fmt: skip
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.double(), want_pool, atol=1e-5, rtol=1e-5)
    cuts = [0, 1, 17, 30]
    x, dt, A, B, C, D, dt_bias, pool = _selective_inputs(rng, cuts[-1])
    assert_split_equals_one_pass(
        FORMS[name], lambda a, b: (x[a:b], dt[a:b], A, B[a:b], C[a:b], D, dt_bias), pool, cuts,
        atol=2e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("backend", backends())
def test_a_decay_per_state_dimension_in_bf16(rng, backend):
    """bf16 x/B/C into an fp32 ``out`` with a decay per state dimension: the kernel equals
    the reference on the same inputs."""
    lens = [21, 1, 1]
    x, dt, A, B, C, D, dt_bias, pool = _selective_inputs(rng, sum(lens), dtype=torch.bfloat16)
    starts, slots = loc(lens), torch.tensor([2, 0, 4])
    results = []
    forms = ((mamba_ssm.mamba_chunk_scan_torch, {}), (mamba_chunk_scan, {"backend": backend}))
    for fn, kwargs in forms:
        p, out = pool.clone(), torch.empty(x.shape, dtype=torch.float32)
        fn(x, dt, A, B, C, D, dt_bias, p, starts, slots, out=out, **kwargs)
        results.append((out, p))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", *backends()])
def test_lightning_attention_matches_its_float64_loop(rng, backend):
    """Per head ``S = exp(-slope) S + k^T v``, ``o = q S`` (transformers' recurrent form, its
    state ``[k_dim, v_dim]``; ours holds the transpose): a prefill past two chunks, decodes and
    an empty sequence, fresh and continued; outputs and states."""
    heads, dim = 3, 8
    lens, slots = [70, 1, 0, 4], [2, 0, 1, 3]
    fresh = torch.tensor([True, False, True, False])
    q, k, v = torch.randn(3, sum(lens), heads, dim, generator=rng).mul(0.5)
    slope = torch.tensor([0.5, 0.1, 0.02])
    pool = torch.randn(5, heads, dim, dim, generator=rng) * 0.3
    want, want_pool, t = torch.zeros(sum(lens), heads, dim, dtype=torch.float64), pool.double(), 0
    for n, slot, warm in zip(lens, slots, fresh.tolist(), strict=True):
        state = want_pool[slot].transpose(1, 2).clone() if warm else torch.zeros(heads, dim, dim)
        for r in range(t, t + n):
            kv = k[r].double()[:, :, None] * v[r].double()[:, None, :]  # [H, k, v]
            state = torch.exp(-slope.double())[:, None, None] * state + kv
            want[r] = torch.einsum("hk,hkv->hv", q[r].double(), state)
        if n:
            want_pool[slot] = state.transpose(1, 2)
        t += n
    out = torch.empty(sum(lens), heads, dim)
    lightning_attention(q, k, v, slope, pool, loc(lens), torch.tensor(slots), fresh, out=out,
                        backend=backend)  # fmt: skip
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.double(), want_pool, atol=1e-5, rtol=1e-5)


def test_the_chunked_form_refuses_a_decay_per_state_dimension(rng):
    x, dt, A, B, C, D, dt_bias, pool = _selective_inputs(rng, 4)
    with pytest.raises(ValueError, match="chunked scan takes A"):
        mamba_chunk_scan_chunked_torch(x, dt, A, B, C, D, dt_bias, pool, loc([4]),
                                       torch.tensor([0]))  # fmt: skip


def test_reference_matches_transformers(rng):
    """One 80-token sequence from a non-zero state equals transformers' ``mamba2_chunk_scan``
    (output and final state); the next token equals ``mamba2_selective_state_update``."""
    x, dt, A, B, C, D, dt_bias, pool = _inputs(rng, 81)
    x = x.contiguous()
    want, want_state = mamba2_chunk_scan(
        x[None, :80], dt[None, :80], A, B[None, :80], C[None, :80], 64, D=D, dt_bias=dt_bias,
        initial_states=pool[3:4].clone(), dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    for form in (mamba_chunk_scan_recurrent_torch, mamba_chunk_scan_chunked_torch):
        p = pool.clone()
        got = form(x[:80], dt[:80], A, B[:80], C[:80], D, dt_bias, p, loc([80]),
                   torch.tensor([3]))  # fmt: skip
        torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p[3], want_state[0], atol=1e-5, rtol=1e-5)
    hf_state = want_state.clone()
    per_channel = dict(dt=dt[80:, :, None].expand(-1, -1, HEAD_DIM),  # as transformers' mixer
                       A=A[:, None, None].expand(-1, HEAD_DIM, STATE_DIM),
                       D=D[:, None].expand(-1, HEAD_DIM),
                       dt_bias=dt_bias[:, None].expand(-1, HEAD_DIM))  # fmt: skip
    want_decode = mamba2_selective_state_update(
        hf_state, x[80:], B=B[80:], C=C[80:], dt_softplus=True, **per_channel
    )
    got = mamba_chunk_scan_recurrent_torch(x[80:], dt[80:], A, B[80:], C[80:], D, dt_bias, p,
                                           loc([1]), torch.tensor([3]))  # fmt: skip
    torch.testing.assert_close(got, want_decode, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p[3], hf_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_split_over_steps_equals_one_pass(rng, name):
    """A prompt cut at arbitrary points (inside and across chunks, single tokens) carries its
    state from call to call and equals one pass; a first call without an initial state starts
    from zero whatever the slot held."""
    cuts = [0, 1, 37, 38, 70, 99, 140]
    x, dt, A, B, C, D, dt_bias, pool = _inputs(rng, cuts[-1])
    assert_split_equals_one_pass(
        FORMS[name], lambda a, b: (x[a:b], dt[a:b], A, B[a:b], C[a:b], D, dt_bias), pool, cuts,
        atol=2e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_decode_batch_into_out(rng, name):
    """One token for each of four sequences (the decode step), slots out of order, written
    into a given ``out``."""
    *tensors, pool = _inputs(rng, 4)
    out = torch.full((4, HEADS, HEAD_DIM), float("nan"))
    got = assert_decode_batch(FORMS[name], mamba_chunk_scan_chunked_torch, tensors, pool,
                              rtol=1e-5, out=out)  # fmt: skip
    assert got is out


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("lens", [[33, 1, 1], [1, 1, 1]], ids=["prefill", "decode"])
def test_bf16_inputs(rng, backend, lens):
    """bf16 x/dt/B/C with the fp32 state: the kernel equals the reference on the same inputs up
    to bf16 rounding of the output; the states agree to fp32 rounding."""
    *tensors, pool = _inputs(rng, sum(lens), dtype=torch.bfloat16)
    assert_bf16_matches_reference(mamba_chunk_scan, mamba_ssm.mamba_chunk_scan_torch, tensors,
                                  pool, lens, backend, pool_rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("backend", backends())
def test_bf16_inputs_into_an_fp32_out(rng, backend):
    """bf16 x/B/C written into an fp32 ``out`` (the Mamba-2 mixer keeps the scan unrounded):
    the kernel's output is the reference's fp32 output, not its bf16 rounding."""
    lens = [33, 1, 1]
    x, dt, A, B, C, D, dt_bias, pool = _inputs(rng, sum(lens), dtype=torch.bfloat16)
    starts, slots = loc(lens), torch.tensor([2, 0, 4])
    outs, pools = [], []
    for fn, kwargs in (
        (mamba_ssm.mamba_chunk_scan_torch, {}),
        (mamba_chunk_scan, {"backend": backend}),
    ):
        p, out = pool.clone(), torch.empty(x.shape, dtype=torch.float32)
        got = fn(x, dt, A, B, C, D, dt_bias, p, starts, slots, out=out, **kwargs)
        assert got is out and out.dtype == torch.float32
        outs.append(out)
        pools.append(p)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[1], pools[0], rtol=1e-5, atol=1e-6)
    rounded = outs[0].to(torch.bfloat16).float()
    assert (outs[1] - rounded).abs().max() > 0  # not rounded to bf16 on the way


@needs_cpu
def test_auto_on_cpu_picks_the_cpp_kernel_for_its_dtypes(rng, monkeypatch):
    """fp32 and bf16 go to the C++ op; fp16 (which it does not take) to the reference."""
    calls = []
    for fn in ("mamba_chunk_scan_cpu", "mamba_chunk_scan_torch"):
        real = getattr(mamba_ssm, fn)
        monkeypatch.setattr(mamba_ssm, fn, lambda *a, _f=real, _n=fn: calls.append(_n) or _f(*a))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, dt, A, B, C, D, dt_bias, pool = _inputs(rng, 3, dtype=dtype)
        mamba_chunk_scan(x, dt, A, B, C, D, dt_bias, pool, loc([2, 1]), torch.tensor([0, 1]))
    assert calls == ["mamba_chunk_scan_cpu", "mamba_chunk_scan_cpu", "mamba_chunk_scan_torch"]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(dt=lambda t: t[:, :2]), "^dt "),
        (dict(A=lambda t: t[:2]), "^A "),
        (dict(A=lambda t: t[:, None].expand(-1, 3)), "^A .*state_dim"),
        (dict(D=lambda t: t[:2]), "^D "),
        (dict(dt_bias=lambda t: t[:2]), "^dt_bias "),
        (dict(B=lambda t: t[:, :, :4]), "^C .* B "),
        (dict(B=lambda t: t.expand(-1, 3, -1), C=lambda t: t.expand(-1, 3, -1)), "^B .*groups"),
        (dict(pool=lambda t: t[:, :2]), "^state_pool "),
        (dict(slots=lambda t: t[:1]), "^state_indices "),
        (dict(fresh=lambda t: t[:1]), "^has_initial_state "),
    ],
)
def test_bad_shapes_are_named(rng, bad, match):
    x, dt, A, B, C, D, dt_bias, pool = _inputs(rng, 4, num_groups=1)
    args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, pool=pool, loc=loc([3, 1]),
                slots=torch.tensor([0, 1]), fresh=torch.tensor([True, True]))  # fmt: skip
    for key, change in bad.items():
        args[key] = change(args[key])
    with pytest.raises(ValueError, match=match):
        mamba_chunk_scan(*args.values())

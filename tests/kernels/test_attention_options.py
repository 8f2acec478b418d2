"""Sliding windows, sinks, soft-capping and ALiBi equal a plain dense implementation on every
backend.

The oracle gathers each request's K/V by position and computes, in float64, Hugging Face's
masked softmax: scores ``q . k * scale``, ``c * tanh(s / c)`` when capped, ``slope * k`` added
per head under ALiBi (as BLOOM does), keys outside ``q - W < k <= q`` masked, a sink column
joined to the softmax and dropped.
"""

import pytest
import torch
from kernel_batch import random_batch, rel_err

from engine.attention import AttentionMetadata, PagedAttention
from kernels import unified_attention
from kernels.cpu_attention import cpu_kernels_available, unified_attention_cpu
from kernels.reference import unified_attention_torch

fp32, bf16 = torch.float32, torch.bfloat16
TOLERANCE = {fp32: 1e-5, bf16: 1e-2}

# (query_lens, context_lens) in one varlen batch: a decode deep in its context, a chunk with
# cached context (a prefix-cache hit or chunked prefill), a whole prompt, a short decode, and a
# chunk that starts mid-context. Window 1 sees each token alone; 5 and 13 are shorter than most
# contexts and no multiple of the block size; 1000 is longer than every context.
MIX = ([1, 7, 20, 1, 3], [70, 13, 0, 4, 40])
WINDOWS = [1, 5, 13, 1000]


def dense_attention(
    batch, sliding_window=None, sinks=None, logits_soft_cap=None, chunk=None, alibi_slopes=None
):
    """The oracle: per request, its K/V gathered by position, attention in float64 (``chunk``:
    Hugging Face's ``chunked_overlay``, keys of the query's own chunk only)."""
    kv_cache, table = batch.kv_cache.double(), batch.block_table.long()
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = batch.query.shape[1] // num_kv_heads
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(lens):
        pos = torch.arange(seq_len)
        blocks = table[i, pos // block_size]
        k = kv_cache[0, blocks, pos % block_size].repeat_interleave(group, 1)  # [L, H, D]
        v = kv_cache[1, blocks, pos % block_size].repeat_interleave(group, 1)
        q = batch.query[starts[i] : starts[i + 1]].double()  # [Lq, H, D]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)
        s = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if logits_soft_cap is not None:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        if alibi_slopes is not None:
            s = s + alibi_slopes.double()[:, None, None] * pos.double()[None, None, :]
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        if chunk is not None:
            visible &= pos[None, :] // chunk == q_pos[:, None] // chunk
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
            p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def _batch(rng, dtype=fp32, cache_dtype=None, queries_per_kv=3, head_dim=64, block_size=16,
           mix=MIX):  # fmt: skip
    batch = random_batch(rng, *mix, 2, queries_per_kv, head_dim, block_size, dtype)
    if cache_dtype is not None:
        batch.kv_cache = batch.kv_cache.to(cache_dtype)
    return batch


def _sinks(rng, num_heads, dtype=fp32):
    # Some sinks far above the scores (they take most of the mass), some far below; in the
    # model's dtype, as gpt-oss's parameter.
    return (torch.randn(num_heads, generator=rng) * 3).to(dtype)


def _slopes(rng, num_heads):
    # BLOOM's slopes run from 2^-1 down to 2^-8; random ones in that range, per head.
    return 2.0 ** -(1 + 7 * torch.rand(num_heads, generator=rng))


OPTION_CASES = {
    "window": lambda rng, h, t=fp32: {"sliding_window": 5},
    "sinks": lambda rng, h, t=fp32: {"sinks": _sinks(rng, h, t)},
    "softcap": lambda rng, h, t=fp32: {"logits_soft_cap": 1.5},
    "all": lambda rng, h, t=fp32: {
        "sliding_window": 13,
        "sinks": _sinks(rng, h, t),
        "logits_soft_cap": 2.0,
    },
    "alibi": lambda rng, h, t=fp32: {"alibi_slopes": _slopes(rng, h)},
    "alibi_window_softcap": lambda rng, h, t=fp32: {
        "alibi_slopes": _slopes(rng, h),
        "sliding_window": 13,
        "logits_soft_cap": 2.0,
    },
}


def _call(backend, batch, **options):
    out = torch.full_like(batch.query, float("nan"))  # poisoned: every element must be written
    result = unified_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, out=out, backend=backend, **options,
    )  # fmt: skip
    assert result is out and not out.isnan().any()
    return out


# ---- the torch reference ---------------------------------------------------------------------


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("dtype", [fp32, bf16])
def test_reference_options_equal_dense(rng, case, dtype):
    batch = _batch(rng, dtype)
    options = OPTION_CASES[case](rng, batch.query.shape[1])
    out = _call("torch", batch, **options)
    assert rel_err(out, dense_attention(batch, **options)) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_windows_shorter_and_longer_than_context(rng, window):
    batch = _batch(rng, block_size=8)
    out = _call("torch", batch, sliding_window=window)
    assert rel_err(out, dense_attention(batch, sliding_window=window)) < 1e-5


def test_window_changes_the_result_and_a_window_past_every_context_does_not(rng):
    batch = _batch(rng)
    plain = _call("torch", batch)
    assert rel_err(_call("torch", batch, sliding_window=5), plain) > 1e-2
    assert rel_err(_call("torch", batch, sliding_window=1000), plain) < 1e-6


# ---- the engine's layer ----------------------------------------------------------------------


def _metadata(batch) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.full((batch.query.shape[0],), -1),  # nothing new to write
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
    )


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_paged_attention_without_options_is_bit_identical_to_plain(rng, backend):
    if backend == "cpu" and not cpu_kernels_available():
        pytest.skip("the C++ CPU kernels cannot be built here")
    batch = _batch(rng)
    layer = PagedAttention(batch.scale, backend, sliding_window=None, sinks=None,
                           logits_soft_cap=None)  # fmt: skip
    key = value = batch.query.new_zeros(batch.query.shape[0], 2, batch.query.shape[2])
    out = layer(batch.query, key, value, batch.kv_cache, _metadata(batch))
    plain = unified_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, backend=backend,
    )  # fmt: skip
    assert torch.equal(out, plain)


def test_paged_attention_carries_its_options_to_the_backend(rng):
    batch = _batch(rng)
    sinks = _sinks(rng, batch.query.shape[1])
    layer = PagedAttention(batch.scale, "torch", sliding_window=13, sinks=sinks,
                           logits_soft_cap=2.0)  # fmt: skip
    key = value = batch.query.new_zeros(batch.query.shape[0], 2, batch.query.shape[2])
    out = layer(batch.query, key, value, batch.kv_cache, _metadata(batch))
    expected = dense_attention(batch, sliding_window=13, sinks=sinks, logits_soft_cap=2.0)
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize(
    "options,field",
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": 4.5}, "sliding_window"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap"),
        ({"logits_soft_cap": float("inf")}, "logits_soft_cap"),
        ({"sinks": torch.zeros(2, 3)}, "sinks"),
        ({"alibi_slopes": torch.zeros(2, 3)}, "alibi_slopes"),
        ({"alibi_slopes": torch.zeros(3, dtype=torch.long)}, "alibi_slopes"),
        ({"alibi_slopes": torch.zeros(3), "sinks": torch.zeros(3)}, "alibi_slopes"),
    ],
)
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        PagedAttention(0.125, "torch", **options)


def test_sinks_of_the_wrong_length_are_refused(rng):
    batch = _batch(rng)
    with pytest.raises(ValueError, match="sinks must have one logit per query head"):
        _call("torch", batch, sinks=torch.zeros(batch.query.shape[1] + 1))


def test_reference_plain_path_is_unchanged(rng):
    # None options take SDPA exactly as before: same bits as a call that names no option.
    batch = _batch(rng)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_table, batch.scale)  # fmt: skip
    assert torch.equal(
        unified_attention_torch(*args),
        unified_attention_torch(*args, sliding_window=None, sinks=None, logits_soft_cap=None),
    )


# ---- the C++ CPU kernel ----------------------------------------------------------------------

needs_cpu = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels cannot be built here"
)


@needs_cpu
@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize(
    "dtype,cache_dtype", [(fp32, fp32), (fp32, bf16), (bf16, bf16)], ids=["fp32", "bf16kv", "bf16"]
)
def test_cpu_options_equal_dense(rng, case, dtype, cache_dtype):
    batch = _batch(rng, dtype, cache_dtype)
    options = OPTION_CASES[case](rng, batch.query.shape[1], dtype)
    out = _cpu(batch, **options)
    assert rel_err(out, dense_attention(batch, **options)) < TOLERANCE[dtype]


def _cpu(batch, **kwargs):
    out = torch.full_like(batch.query, float("nan"))
    unified_attention_cpu(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, out=out, **kwargs,
    )  # fmt: skip
    assert not out.isnan().any(), "some output elements were never written"
    return out


# Every path of the kernel: GQA 1 (one-row decodes, 32-token prefill tiles), 8 (decodes of 8
# rows), a head size off the vector paths (48: the scalar loop), block sizes 8 to 64.
SHAPES = [(1, 128, 8), (3, 64, 16), (8, 96, 32), (4, 48, 64)]


@needs_cpu
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("queries_per_kv,head_dim,block_size", SHAPES)
def test_cpu_all_options_every_path(rng, queries_per_kv, head_dim, block_size, window):
    batch = _batch(rng, fp32, bf16, queries_per_kv, head_dim, block_size)
    heads = batch.query.shape[1]
    options = {"sliding_window": window, "sinks": _sinks(rng, heads), "logits_soft_cap": 3.0}
    assert rel_err(_cpu(batch, **options), dense_attention(batch, **options)) < 1e-5
    options = {"sliding_window": window, "alibi_slopes": _slopes(rng, heads)}
    assert rel_err(_cpu(batch, **options), dense_attention(batch, **options)) < 1e-5


@needs_cpu
@pytest.mark.parametrize("kv_split_size", [16, 48])
@pytest.mark.parametrize("cache_dtype", [fp32, bf16])
def test_cpu_split_chunks_merge_with_options(rng, kv_split_size, cache_dtype):
    # Long decodes and a chunk cut into KV chunks: a chunk may hold no key of a row's window,
    # and the sink joins once, when the chunks merge.
    batch = _batch(rng, fp32, cache_dtype, mix=([1, 1, 5, 1], [300, 150, 200, 40]))
    for options in (
        {"sliding_window": 100, "sinks": _sinks(rng, batch.query.shape[1])},
        {"sliding_window": 37, "logits_soft_cap": 2.0},
        {"sinks": _sinks(rng, batch.query.shape[1]), "logits_soft_cap": 2.0},
        {"alibi_slopes": _slopes(rng, batch.query.shape[1])},
    ):
        out = _cpu(batch, kv_split_size=kv_split_size, **options)
        assert rel_err(out, dense_attention(batch, **options)) < 1e-5


@needs_cpu
@pytest.mark.parametrize("dtype,cache_dtype", [(fp32, fp32), (bf16, bf16)])
def test_cpu_decode_never_reads_blocks_before_the_window(rng, dtype, cache_dtype):
    # Blocks wholly before each decode's window are poisoned with NaN after the oracle ran: a
    # kernel that read them (even with p = 0) would give NaN.
    block_size, window = 16, 40
    batch = _batch(rng, dtype, cache_dtype, block_size=block_size,
                   mix=([1, 1, 1], [700, 333, 64]))  # fmt: skip
    expected = dense_attention(batch, sliding_window=window)
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        first_block = (seq_len - window) // block_size
        batch.kv_cache[:, batch.block_table[i, :first_block].long()] = float("nan")
    out = _cpu(batch, sliding_window=window)
    assert rel_err(out, expected) < TOLERANCE[dtype]


# ---- Triton, under the interpreter (tests/kernels/conftest.py): few and tiny cases -------------


def _triton(batch, **kwargs):
    from kernels.triton_attention import unified_attention_triton

    out = torch.full_like(batch.query, float("nan"))
    unified_attention_triton(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, out=out, **kwargs,
    )  # fmt: skip
    assert not out.isnan().any(), "some output elements were never written"
    return out


@pytest.mark.parametrize("case", ["window", "all"])
@pytest.mark.parametrize("dtype", [fp32, bf16])
def test_triton_options_equal_dense(rng, case, dtype):
    batch = _batch(rng, dtype, mix=([1, 5, 9, 1], [40, 13, 0, 3]))
    options = OPTION_CASES[case](rng, batch.query.shape[1], dtype)
    out = _triton(batch, **options)
    assert rel_err(out, dense_attention(batch, **options)) < TOLERANCE[dtype]


def test_triton_softcap_and_sinks_alone(rng):
    batch = _batch(rng, mix=([1, 6], [30, 9]))
    for options in ({"logits_soft_cap": 1.5}, {"sinks": _sinks(rng, batch.query.shape[1])}):
        assert rel_err(_triton(batch, **options), dense_attention(batch, **options)) < 1e-5


def test_triton_alibi_unified_and_split_decode(rng):
    """ALiBi with a window on a mixed batch (the unified kernel), then on decodes split four
    ways (each segment biased by its own keys' distance)."""
    batch = _batch(rng, mix=([1, 5, 9, 1], [40, 13, 0, 3]))
    options = OPTION_CASES["alibi_window_softcap"](rng, batch.query.shape[1])
    assert rel_err(_triton(batch, **options), dense_attention(batch, **options)) < 1e-5
    batch = _batch(rng, mix=([1, 1], [300, 70]))
    options = {"alibi_slopes": _slopes(rng, batch.query.shape[1])}
    expected = dense_attention(batch, **options)
    assert rel_err(_triton(batch, num_splits=4, **options), expected) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_reads_the_window_only(rng, num_splits):
    # Unified and split-K decodes: blocks wholly before each window are poisoned with NaN after
    # the oracle ran; the window's keys are split into segments, the sink joins at the merge.
    block_size, window = 16, 40
    batch = _batch(rng, block_size=block_size, mix=([1, 1], [300, 70]))
    sinks = _sinks(rng, batch.query.shape[1])
    options = {"sliding_window": window, "sinks": sinks, "logits_soft_cap": 2.0}
    expected = dense_attention(batch, **options)
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        first_block = (seq_len - window) // block_size
        batch.kv_cache[:, batch.block_table[i, :first_block].long()] = float("nan")
    assert rel_err(_triton(batch, num_splits=num_splits, **options), expected) < 1e-5


# ---- chunked local attention (Llama 4) -------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_local_attention_equals_the_chunk_mask(rng, backend, chunk):
    """Queries that cross chunk borders (a 20-token prompt, a chunk from 13 to 20, a decode at
    70) see their own chunk's keys only: the step split into virtual requests, one per chunk."""
    if backend == "cpu" and not cpu_kernels_available():
        pytest.skip("the C++ CPU kernels cannot be built here")
    batch = _batch(rng, block_size=8)
    layer = PagedAttention(batch.scale, backend, attention_chunk_size=chunk)
    key = value = batch.query.new_zeros(batch.query.shape[0], 2, batch.query.shape[2])
    out = layer(batch.query, key, value, batch.kv_cache, _metadata(batch))
    assert rel_err(out, dense_attention(batch, chunk=chunk)) < 1e-5
    assert rel_err(out, dense_attention(batch)) > 1e-2  # the chunks changed the result


def test_a_chunk_past_every_context_is_plain_attention(rng):
    batch = _batch(rng, block_size=8)
    meta = _metadata(batch)
    from engine.chunked_local_attention import local_metadata

    assert local_metadata(meta, 128, 8) is meta


def test_a_chunk_that_is_not_whole_blocks_is_refused(rng):
    batch = _batch(rng, block_size=16)
    layer = PagedAttention(batch.scale, "torch", attention_chunk_size=24)
    key = value = batch.query.new_zeros(batch.query.shape[0], 2, batch.query.shape[2])
    with pytest.raises(ValueError, match="attention_chunk_size=24 must be a multiple of block_s"):
        layer(batch.query, key, value, batch.kv_cache, _metadata(batch))

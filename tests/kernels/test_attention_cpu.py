"""The C++ CPU attention and KV write equal the torch reference on random paged batches."""

import pytest
import torch
from kernel_batch import random_batch, rel_err

from kernels import allocate_kv_cache, select_backend, unified_attention, write_kv
from kernels.cpu_attention import cpu_kernels_available, unified_attention_cpu, write_kv_cpu
from kernels.reference import unified_attention_torch, write_kv_torch

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels cannot be built here"
)

# (query_lens, context_lens): decodes, chunked prefill with cached context, whole prompts, a mix
# of all three in one batch (two prefill tiles long, with decodes in between).
MIXES = {
    "decode": ([1, 1, 1], [17, 40, 5]),
    "chunks": ([7, 12], [20, 33]),
    "prompts": ([9, 21], [0, 0]),
    "mixed": ([1, 6, 45, 1, 3], [30, 11, 0, 0, 70]),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
fp32, bf16 = torch.float32, torch.bfloat16

# Every GQA ratio, head size and block size appears with both dtypes and with the mixed batch.
CASES = [
    # queries_per_kv, head_dim, block_size, dtype, mix
    (1, 64, 16, fp32, "mixed"),
    (3, 64, 32, fp32, "mixed"),
    (4, 128, 16, fp32, "mixed"),
    (8, 64, 8, fp32, "mixed"),
    (3, 80, 64, fp32, "mixed"),
    (4, 96, 8, fp32, "chunks"),
    (1, 128, 64, fp32, "prompts"),
    (8, 128, 32, fp32, "decode"),
    (1, 80, 16, bf16, "mixed"),
    (3, 64, 16, bf16, "mixed"),
    (4, 96, 32, bf16, "mixed"),
    (8, 128, 64, bf16, "mixed"),
    (3, 128, 8, bf16, "decode"),
    (4, 64, 32, bf16, "prompts"),
    (8, 80, 16, bf16, "chunks"),
]


def _run(batch, kv_cache=None, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))  # poisoned: every element must be written
    result = unified_attention_cpu(
        batch.query, batch.kv_cache if kv_cache is None else kv_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, batch.scale, out=out, **kwargs,
    )  # fmt: skip
    assert result is out
    assert not out.isnan().any(), "some output elements were never written"
    return out


def _reference(batch, kv_cache=None) -> torch.Tensor:
    return unified_attention_torch(
        batch.query, batch.kv_cache if kv_cache is None else kv_cache, batch.query_start_loc,
        batch.seq_lens, batch.block_table, batch.scale,
    )  # fmt: skip


@pytest.mark.parametrize(
    "queries_per_kv,head_dim,block_size,dtype,mix",
    CASES,
    ids=[f"gqa{g}-d{d}-bs{b}-{str(t)[6:]}-{m}" for g, d, b, t, m in CASES],
)
def test_cpu_attention_matches_reference(rng, queries_per_kv, head_dim, block_size, dtype, mix):
    query_lens, context_lens = MIXES[mix]
    batch = random_batch(
        rng, query_lens, context_lens, 2, queries_per_kv, head_dim, block_size, dtype
    )
    assert rel_err(_run(batch), _reference(batch)) < TOLERANCE[dtype]


@pytest.mark.parametrize("kv_split_size", [16, 64, 100])
@pytest.mark.parametrize("dtype", [fp32, bf16])
def test_split_kv_partials_merge_exactly(rng, kv_split_size, dtype):
    """Forced small KV chunks: decodes and prefill tiles both split, empty chunks weigh 0."""
    batch = random_batch(rng, [1, 1, 9, 1], [700, 3, 250, 129], 2, 4, 64, 16, dtype)
    assert rel_err(_run(batch, kv_split_size=kv_split_size), _reference(batch)) < TOLERANCE[dtype]


def test_long_decode_splits_by_itself_and_stays_exact(rng):
    # One request, long context: the kernel's own choice splits it over the threads.
    batch = random_batch(rng, [1], [3000], 1, 8, 128, 32, fp32)
    assert rel_err(_run(batch), _reference(batch)) < 1e-5


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_bf16_cache_under_an_fp32_model(rng, head_dim):
    """kv_cache_dtype=bfloat16: fp32 queries read bf16 K/V, accumulating in fp32.

    Head sizes of whole pairs of vectors (64, 96, 128 with AVX-512) take the decode's pair
    widening and, with AVX512-BF16, its bf16 dot products against q split into hi + lo; 80
    does not. Both must stay within fp32 rounding of the reference.
    """
    batch = random_batch(rng, [1, 6, 1], [40, 9, 300], 2, 3, head_dim, 16, fp32)
    kv_bf16 = batch.kv_cache.to(bf16)
    out = _run(batch, kv_cache=kv_bf16)
    assert out.dtype == fp32
    assert rel_err(out, _reference(batch, kv_bf16)) < 1e-5


def head_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """The same cache stored as the engine allocates it for the C++ kernels."""
    return kv_cache.transpose(2, 3).contiguous().transpose(2, 3)


@pytest.mark.parametrize("dtype", [fp32, bf16])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_head_major_cache_gives_the_same_output(rng, mix, dtype):
    """The engine's CPU caches are head-major inside each block: same numbers, other strides."""
    batch = random_batch(rng, *MIXES[mix], 2, 3, 64, 16, dtype)
    cache = head_major(batch.kv_cache)
    assert not cache.is_contiguous() and torch.equal(cache, batch.kv_cache)
    assert torch.equal(_run(batch, kv_cache=cache), _run(batch))
    assert rel_err(_reference(batch, cache), _reference(batch)) == 0


def test_allocate_kv_cache_is_head_major_for_the_cpu_kernels():
    cache = allocate_kv_cache(5, 16, 3, 64, fp32, "cpu", backend="cpu")
    assert cache.shape == (2, 5, 16, 3, 64) and not cache.any()
    assert cache.stride() == (5 * 3 * 16 * 64, 3 * 16 * 64, 64, 16 * 64, 1)
    torch_cache = allocate_kv_cache(5, 16, 3, 64, bf16, "cpu", backend="torch")
    assert torch_cache.is_contiguous() and torch_cache.dtype == bf16


def test_int64_metadata_and_contiguous_query(rng):
    batch = random_batch(rng, [3, 1, 17], [5, 20, 40], 2, 2, 64, 32, fp32, torch.int64)
    batch.query = batch.query.contiguous()
    assert rel_err(_run(batch), _reference(batch)) < 1e-5


@pytest.mark.parametrize("case", range(12))
def test_random_batches_match_reference(rng, case):
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    num_seqs = int(torch.randint(1, 8, (1,), generator=rng))
    query_lens = [
        pick([1, 1, int(torch.randint(2, 80, (1,), generator=rng))]) for _ in range(num_seqs)
    ]
    context_lens = [
        pick([0, int(torch.randint(1, 300, (1,), generator=rng))]) for _ in range(num_seqs)
    ]
    dtype = pick([fp32, bf16])
    batch = random_batch(
        rng, query_lens, context_lens, pick([1, 2, 3]), pick([1, 3, 4, 8]),
        pick([64, 80, 96, 128]), pick([8, 16, 32, 64]), dtype, pick([torch.int32, torch.int64]),
    )  # fmt: skip
    split = pick([0, 0, 32])
    assert rel_err(_run(batch, kv_split_size=split), _reference(batch)) < TOLERANCE[dtype]


def test_public_entry_points_use_the_cpu_kernels(rng):
    assert select_backend("cpu") == "cpu"
    batch = random_batch(rng, [3, 1], [5, 20], 2, 2, 64, 32, fp32)
    out = unified_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, backend="cpu",
    )  # fmt: skip
    assert rel_err(out, _reference(batch)) < 1e-5


def test_shape_mismatch_is_reported(rng):
    batch = random_batch(rng, [2], [0], 2, 3, 64, 16, fp32)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        unified_attention_cpu(
            batch.query[:, :5], batch.kv_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_table, batch.scale,
        )  # fmt: skip


KV_CASES = [
    # num_kv_heads, head_dim, block_size, input dtype, cache dtype
    (1, 64, 16, fp32, fp32),
    (3, 64, 32, fp32, bf16),  # cast on write, rounded to nearest even like torch
    (2, 128, 8, bf16, bf16),
    (2, 80, 64, fp32, fp32),
]


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size,dtype,cache_dtype",
    KV_CASES,
    ids=[f"kv{h}-d{d}-bs{b}-{str(t)[6:]}-{str(c)[6:]}" for h, d, b, t, c in KV_CASES],
)
def test_write_kv_matches_reference(rng, num_kv_heads, head_dim, block_size, dtype, cache_dtype):
    num_blocks, num_tokens = 5, 11
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=rng).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[:3]] = -1  # padding tokens
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    expected = torch.full(shape, float("nan"), dtype=cache_dtype)
    actual = expected.clone()

    in_head_major = head_major(expected)
    in_head_major_torch = head_major(expected)

    write_kv_torch(key, value, expected, slots)
    write_kv_cpu(key, value, actual, slots)
    write_kv_cpu(key, value, in_head_major, slots)
    write_kv_torch(key, value, in_head_major_torch, slots)

    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num())
    assert (~actual.isnan()).view(2, -1, num_kv_heads * head_dim).all(-1).sum() == 2 * 8
    for other in (in_head_major, in_head_major_torch):
        assert torch.equal(other.isnan(), expected.isnan())
        assert torch.equal(other.nan_to_num(), expected.nan_to_num())


def test_write_kv_refuses_a_slot_beyond_the_cache():
    key = torch.zeros(2, 1, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        write_kv(key, key, torch.zeros(2, 1, 16, 1, 64), torch.tensor([3, 16]), backend="cpu")


# ---- AMX decodes (bf16 caches on CPUs with AMX) ----------------------------------------------


def _amx_available() -> bool:
    from kernels.cpu_attention import amx_decode_available

    return cpu_kernels_available() and amx_decode_available()


amx_only = pytest.mark.skipif(
    not _amx_available(), reason="no AMX here (or PAGEDQ_CPU_AMX=0): bf16 decodes take AVX"
)


def _run_both(batch, monkeypatch, kv_cache=None, **kwargs):
    """The kernel's output with AMX, then with the AVX path (``PAGEDQ_CPU_AMX=0``)."""
    amx = _run(batch, kv_cache, **kwargs)
    monkeypatch.setenv("PAGEDQ_CPU_AMX", "0")
    avx = _run(batch, kv_cache, **kwargs)
    monkeypatch.delenv("PAGEDQ_CPU_AMX")
    return amx, avx


def _fp32_reference(batch, kv_cache=None):
    """The reference in fp32 on the same (bf16) values: what both paths approximate."""
    cache = (batch.kv_cache if kv_cache is None else kv_cache).float()
    return unified_attention_torch(
        batch.query.float(), cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale,
    )  # fmt: skip


# Decodes (contexts off multiples of 16) and a short chunk whose rows still fit a tile
# (q_len x group <= 8) next to a prefill, over every supported head and block size.
AMX_CASES = [
    # queries_per_kv, head_dim, block_size
    (1, 64, 16),
    (3, 64, 16),
    (3, 64, 8),
    (2, 128, 32),
    (4, 96, 16),
    (5, 64, 32),  # 5-8 rows: p's even and odd rows in two tiles
    (8, 128, 8),
]


@amx_only
@pytest.mark.parametrize(
    "queries_per_kv,head_dim,block_size",
    AMX_CASES,
    ids=[f"gqa{g}-d{d}-bs{b}" for g, d, b in AMX_CASES],
)
def test_amx_decodes_match_reference(rng, monkeypatch, queries_per_kv, head_dim, block_size):
    q_lens, ctx = [1, 1, 2, 1, 30, 1], [17, 300, 44, 5, 0, 129]
    batch = random_batch(rng, q_lens, ctx, 2, queries_per_kv, head_dim, block_size, bf16)
    amx, avx = _run_both(batch, monkeypatch)
    expected = _fp32_reference(batch)
    assert rel_err(amx, _reference(batch)) < TOLERANCE[bf16]
    # as close to the exact result as the AVX path (both round the output to bf16)
    assert rel_err(amx, expected) < max(1.5 * rel_err(avx, expected), 4e-3)


@amx_only
@pytest.mark.parametrize("head_dim", [64, 128])
def test_amx_decodes_with_fp32_queries(rng, monkeypatch, head_dim):
    """kv_cache_dtype=bfloat16 under an fp32 model: q as bf16 hi + lo keeps fp32 accuracy."""
    batch = random_batch(rng, [1, 1, 1], [40, 9, 300], 2, 4, head_dim, 16, fp32)
    kv_bf16 = batch.kv_cache.to(bf16)
    amx, avx = _run_both(batch, monkeypatch, kv_cache=kv_bf16)
    assert rel_err(amx, _reference(batch, kv_bf16)) < 1e-5
    assert rel_err(avx, _reference(batch, kv_bf16)) < 1e-5


@amx_only
@pytest.mark.parametrize("kv_split_size", [16, 48, 100])
def test_amx_split_kv_merges_exactly(rng, monkeypatch, kv_split_size):
    batch = random_batch(rng, [1, 1, 1, 3], [700, 3, 250, 129], 2, 3, 64, 16, bf16)
    amx, _ = _run_both(batch, monkeypatch, kv_split_size=kv_split_size)
    assert rel_err(amx, _fp32_reference(batch)) < 4e-3


@amx_only
def test_amx_ignores_what_lies_past_the_keys(rng, monkeypatch):
    """Tiles read whole blocks: slots past a request's keys (here NaN) must not leak in."""
    q_lens, ctx = [1, 1, 1], [20, 7, 33]
    for block_size in (8, 16, 32):
        batch = random_batch(rng, q_lens, ctx, 2, 3, 64, block_size, bf16)
        poisoned = batch.kv_cache.clone()
        for i, seq_len in enumerate(batch.seq_lens.tolist()):
            blocks = batch.block_table[i, : -(-seq_len // block_size)]
            last = int(blocks[-1])
            poisoned[:, last, seq_len % block_size or block_size :] = float("nan")
        spare = set(range(poisoned.shape[1])) - set(batch.block_table.flatten().tolist())
        poisoned[:, sorted(spare)] = float("nan")
        amx, avx = _run_both(batch, monkeypatch, kv_cache=poisoned)
        assert not amx.isnan().any() and not avx.isnan().any()
        assert rel_err(amx, _fp32_reference(batch)) < 4e-3

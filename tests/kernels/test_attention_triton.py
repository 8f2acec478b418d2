"""The Triton unified attention equals the torch reference on random paged batches."""

import pytest
import torch
from kernel_batch import random_batch, rel_err

from kernels import unified_attention
from kernels.reference import unified_attention_torch
from kernels.triton_attention import unified_attention_triton
from kernels.triton_split_decode import pick_num_splits

# (query_lens, context_lens): decodes, chunked prefill with cached context, whole prompts, a mix.
MIXES = {
    "decode": ([1, 1, 1], [17, 40, 5]),
    "chunks": ([7, 12], [20, 33]),
    "prompts": ([9, 21], [0, 0]),
    "mixed": ([1, 6, 13, 1], [30, 11, 0, 0]),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16

# Not the cartesian product: every value of every dimension appears, mostly with the mixed batch.
CASES = [
    # queries_per_kv, head_dim, block_size, dtype, mix
    (1, 64, 16, fp32, "mixed"),
    (3, 64, 32, fp32, "mixed"),
    (4, 128, 16, fp32, "chunks"),
    (8, 64, 16, bf16, "mixed"),
    (1, 128, 32, bf16, "prompts"),
    (4, 64, 32, bf16, "decode"),
    (3, 128, 16, bf16, "chunks"),
    (8, 128, 32, fp32, "decode"),
    (4, 64, 16, fp32, "prompts"),
    (1, 128, 16, bf16, "mixed"),
    # head sizes that are padded to the next power of two and masked
    (2, 80, 16, fp32, "mixed"),
    (2, 96, 32, bf16, "mixed"),
    (1, 256, 16, fp32, "chunks"),
    # fp16: what the engine runs on GPUs without bf16
    (4, 128, 16, fp16, "mixed"),
]


def _run(batch, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))  # poisoned: every element must be written
    result = unified_attention_triton(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, out=out, **kwargs,
    )  # fmt: skip
    assert result is out
    assert not out.isnan().any(), "some output elements were never written"
    return out


def _reference(batch) -> torch.Tensor:
    return unified_attention_torch(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale,
    )  # fmt: skip


@pytest.mark.parametrize(
    "queries_per_kv,head_dim,block_size,dtype,mix",
    CASES,
    ids=[f"gqa{g}-d{d}-bs{b}-{str(t)[6:]}-{m}" for g, d, b, t, m in CASES],
)
def test_unified_attention_matches_reference(rng, queries_per_kv, head_dim, block_size, dtype, mix):
    query_lens, context_lens = MIXES[mix]
    batch = random_batch(
        rng, query_lens, context_lens, 2, queries_per_kv, head_dim, block_size, dtype
    )
    out = _run(batch, num_splits=1)
    assert rel_err(out, _reference(batch)) < TOLERANCE[dtype]


SPLIT_CASES = [
    # queries_per_kv, head_dim, block_size, dtype, num_splits
    (1, 64, 16, fp32, 2),
    (4, 128, 32, fp32, 4),
    (8, 64, 32, bf16, 4),
    (3, 64, 16, bf16, 2),
    # more splits than key tiles: empty splits must weigh nothing
    (4, 64, 16, fp32, 16),
    (1, 128, 16, fp16, 4),
]


@pytest.mark.parametrize(
    "queries_per_kv,head_dim,block_size,dtype,num_splits",
    SPLIT_CASES,
    ids=[f"gqa{g}-d{d}-bs{b}-{str(t)[6:]}-split{s}" for g, d, b, t, s in SPLIT_CASES],
)
def test_split_k_decode_matches_reference(
    rng, queries_per_kv, head_dim, block_size, dtype, num_splits
):
    batch = random_batch(rng, [1, 1], [70, 9], 2, queries_per_kv, head_dim, block_size, dtype)
    out = _run(batch, num_splits=num_splits)
    assert rel_err(out, _reference(batch)) < TOLERANCE[dtype]


def test_split_k_refuses_a_batch_with_prefill(rng):
    batch = random_batch(rng, [1, 4], [10, 0], 1, 1, 64, 16, fp32)
    with pytest.raises(ValueError, match="decode-only"):
        _run(batch, num_splits=2)


def test_default_heuristic_splits_a_long_decode_and_stays_exact(rng):
    batch = random_batch(rng, [1], [90], 1, 4, 64, 16, fp32)
    # Bound the context by a wide block table (no host sync): 64 blocks of 16 tokens.
    batch.block_table = torch.cat(
        [batch.block_table, torch.full((1, 64), -1, dtype=torch.int32)], dim=1
    )
    assert pick_num_splits(1, 1, 1, batch.block_table.shape[1] * 16, batch.query.device) > 1
    assert rel_err(_run(batch), _reference(batch)) < 1e-5


@pytest.mark.parametrize(
    "num_tokens,num_seqs,num_kv_heads,max_seq_len,expected",
    [
        (4, 4, 8, 4096, 4),  # few long decodes: split
        (8, 4, 8, 4096, 1),  # a prefill in the batch: never split
        (4, 4, 8, 512, 1),  # short contexts: not worth a reduction
        (64, 64, 8, 4096, 1),  # enough programs to fill the device
        (1, 1, 1, 100_000, 16),  # capped at MAX_SPLITS
    ],
)
def test_pick_num_splits(num_tokens, num_seqs, num_kv_heads, max_seq_len, expected):
    splits = pick_num_splits(num_tokens, num_seqs, num_kv_heads, max_seq_len, torch.device("cpu"))
    assert splits == expected


def test_public_entry_point_with_triton_backend(rng):
    batch = random_batch(rng, [3, 1], [5, 20], 2, 2, 64, 32, fp32)
    out = unified_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, backend="triton",
    )  # fmt: skip
    assert out.shape == batch.query.shape
    assert rel_err(out, _reference(batch)) < 1e-5


def test_shape_mismatch_is_reported(rng):
    batch = random_batch(rng, [2], [0], 2, 3, 64, 16, fp32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        unified_attention_triton(
            batch.query[:, :5], batch.kv_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_table, batch.scale,
        )  # fmt: skip


@pytest.mark.parametrize("case", range(16))
def test_random_batches_match_reference(rng, case):
    """Random sizes per case: long prompts span several query tiles, decodes sit in between.

    Also the block sizes 8 and 64 that the engine allows, and int64 metadata as the engine sends.
    """

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    num_seqs = int(torch.randint(1, 6, (1,), generator=rng))
    query_lens = [
        pick([1, 1, int(torch.randint(2, 80, (1,), generator=rng))]) for _ in range(num_seqs)
    ]
    context_lens = [
        pick([0, int(torch.randint(1, 100, (1,), generator=rng))]) for _ in range(num_seqs)
    ]
    dtype = pick([fp32, bf16])
    batch = random_batch(
        rng, query_lens, context_lens, pick([1, 2]), pick([1, 3, 4, 8]), pick([64, 128]),
        pick([8, 16, 32, 64]), dtype, pick([torch.int32, torch.int64]),
    )  # fmt: skip
    assert rel_err(_run(batch), _reference(batch)) < TOLERANCE[dtype]


def test_bf16_cache_under_an_fp32_query(rng):
    """kv_cache_dtype=bfloat16 with an fp32 model: K/V are upcast on load."""
    batch = random_batch(rng, [1, 6, 1], [30, 11, 40], 2, 3, 64, 16, fp32)
    batch.kv_cache = batch.kv_cache.to(bf16)
    assert rel_err(_run(batch, num_splits=1), _reference(batch)) < 1e-5

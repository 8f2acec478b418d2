"""The Triton KV-cache write equals the torch reference, slot for slot."""

import pytest
import torch

from kernels import write_kv
from kernels.reference import write_kv_torch
from kernels.triton_kv_write import write_kv_triton

CASES = [
    # num_kv_heads, head_dim, block_size, input dtype, cache dtype
    (1, 64, 16, torch.float32, torch.float32),
    (2, 128, 32, torch.bfloat16, torch.bfloat16),
    (3, 64, 32, torch.float32, torch.bfloat16),  # cast on write, rounded to nearest even
    (8, 128, 16, torch.float32, torch.float32),
    (2, 80, 16, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size,dtype,cache_dtype",
    CASES,
    ids=[f"kv{h}-d{d}-bs{b}-{str(t)[6:]}-{str(c)[6:]}" for h, d, b, t, c in CASES],
)
def test_write_kv_matches_reference(rng, num_kv_heads, head_dim, block_size, dtype, cache_dtype):
    num_blocks, num_tokens = 5, 11
    # K and V are non-contiguous views of one fused qkv projection, as in the model.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=rng).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[:3]] = -1  # padding tokens
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    expected = torch.full(shape, float("nan"), dtype=cache_dtype)
    actual = expected.clone()

    write_kv_torch(key, value, expected, slots)
    write_kv_triton(key, value, actual, slots)

    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num())
    written = actual.view(2, -1, num_kv_heads, head_dim)[:, slots[slots >= 0]]
    assert not written.isnan().any()
    # Exactly the valid slots were written: everything else is still poisoned.
    assert (~actual.isnan()).view(2, -1, num_kv_heads * head_dim).all(-1).sum() == 2 * 8


def test_write_kv_rejects_a_cache_of_another_shape():
    key = torch.zeros(2, 2, 64)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        write_kv_triton(key, key, torch.zeros(2, 4, 16, 2, 128), torch.tensor([0, 1]))


def test_public_entry_point_with_triton_backend(rng):
    key = torch.randn(3, 2, 64, generator=rng)
    value = torch.randn(3, 2, 64, generator=rng)
    cache = torch.zeros(2, 2, 16, 2, 64)
    write_kv(key, value, cache, torch.tensor([17, -1, 0]), backend="triton")
    assert torch.equal(cache[0, 1, 1], key[0]) and torch.equal(cache[1, 0, 0], value[2])
    assert cache.count_nonzero() == 2 * 2 * 2 * 64

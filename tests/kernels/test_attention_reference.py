"""The torch reference, the oracle of the Triton kernels, equals dense causal attention."""

import pytest
import torch
import torch.nn.functional as F
from kernel_batch import rel_err

from kernels.reference import unified_attention_torch, write_kv_torch


@pytest.mark.parametrize(
    "queries_per_kv,head_dim,block_size,dtype",
    [(1, 64, 16, torch.float32), (4, 128, 32, torch.float32), (3, 64, 16, torch.bfloat16)],
)
def test_reference_equals_dense_causal_sdpa(rng, queries_per_kv, head_dim, block_size, dtype):
    num_kv_heads = 2
    num_heads = num_kv_heads * queries_per_kv
    # Request i holds seq_lens[i] tokens and queries its last query_lens[i] (decode, chunk, prompt).
    seq_lens, query_lens = [23, 40, 17, 9], [1, 12, 17, 1]
    blocks = [-(-s // block_size) for s in seq_lens]
    kv_cache = torch.zeros(2, sum(blocks), block_size, num_kv_heads, head_dim, dtype=dtype)
    # Identity block table: each request's blocks are consecutive physical blocks.
    block_table = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.int32)
    dense = []
    first = 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, blocks, strict=True)):
        block_table[i, :n] = torch.arange(first, first + n)
        q, k, v = torch.randn(3, seq_len, num_heads, head_dim, generator=rng).to(dtype).unbind(0)
        k, v = k[:, :num_kv_heads], v[:, :num_kv_heads]
        slots = first * block_size + torch.arange(seq_len)
        write_kv_torch(k, v, kv_cache, slots)
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(queries_per_kv, 1).transpose(0, 1),
            v.repeat_interleave(queries_per_kv, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        dense.append((q[-query_lens[i] :], expected[-query_lens[i] :]))
        first += n
    query = torch.cat([q for q, _ in dense])
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    out = unified_attention_torch(
        query, kv_cache, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32), block_table,
        head_dim**-0.5,
    )  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, torch.cat([e for _, e in dense])) < tolerance


def test_reference_many_decodes_of_mixed_lengths_span_several_groups():
    # More decodes than one DECODE_GROUP_SIZE: they are sorted by length and attended in groups.
    from kernels.reference import DECODE_GROUP_SIZE, unified_attention_torch, write_kv_torch

    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    num_reqs = 2 * DECODE_GROUP_SIZE + 6
    lens = torch.randint(1, 200, (num_reqs,), generator=gen).tolist()
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((num_reqs, max_blocks), -1, dtype=torch.long)
    used, keys, values = 0, [], []
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        table[i, :nb] = perm[used : used + nb]
        used += nb
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen) for _ in range(2))
        slots = table[i, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        write_kv_torch(k, v, cache, slots)
        keys.append(k)
        values.append(v)
    query = torch.randn(num_reqs, num_heads, head_dim, generator=gen)
    out = unified_attention_torch(
        query, cache, torch.arange(num_reqs + 1), torch.tensor(lens), table, head_dim**-0.5
    )
    group = num_heads // num_kv_heads
    for i in range(num_reqs):
        k = keys[i].transpose(0, 1).repeat_interleave(group, 0)
        v = values[i].transpose(0, 1).repeat_interleave(group, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(query[i][:, None], k, v)[:, 0]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)

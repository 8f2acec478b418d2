"""Block pool and KV cache manager invariants: ref counts, free-queue order, prefix hits."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_removal_from_middle_is_exact():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4]
    assert q.num_free_blocks == 3
    q.append(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 2]
    assert q.popleft().block_id == 1


def test_blocks_freed_in_reverse_so_tails_are_evicted_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))  # 3 blocks
    assert kv.allocate_slots(req, 10) is not None
    held = kv.get_block_ids("a")[0]
    assert held == [0, 1, 2]
    kv.free(req)
    assert free_ids(kv.block_pool) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    before = (free_ids(kv.block_pool), [b.ref_cnt for b in kv.block_pool.blocks])
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert (free_ids(kv.block_pool), [b.ref_cnt for b in kv.block_pool.blocks]) == before
    assert "b" not in kv.req_to_blocks


def test_prefix_hit_shares_blocks_and_stops_one_token_short():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    system = list(range(8))
    a = make_request("a", system + [100, 101])
    kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    b = make_request("b", system + [200, 201, 202])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [h.block_id for h in hits[0]] == kv.get_block_ids("a")[0][:2]
    kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert [blk.ref_cnt for blk in hits[0]] == [2, 2]
    # A prompt that is exactly the cached blocks still recomputes its last token.
    c = make_request("c", system)
    _, num_hit_c = kv.get_computed_blocks(c)
    assert num_hit_c == 4
    kv.free(a)
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)


def test_eviction_is_lru_and_unpublishes_the_hash():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)  # blocks 1 then 0 join the tail; 2, 3 were free before
    assert free_ids(kv.block_pool) == [2, 3, 1, 0]
    b = make_request("b", [9, 9, 9, 9, 9, 9])
    kv.allocate_slots(b, 6)  # takes 2, 3, then evicts 1 (LRU of the cached ones)
    assert kv.get_block_ids("b") == [[2, 3, 1]]
    again = make_request("c", [1, 2, 3, 4, 5])
    hits, num_hit = kv.get_computed_blocks(again)
    assert [h.block_id for h in hits[0]] == [0] and num_hit == 2


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    kv.free(a)
    b = make_request("b", [1, 2, 7])
    hits, _ = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 1, hits)
    assert hits[0][0].ref_cnt == 1
    assert hits[0][0].block_id not in free_ids(kv.block_pool)
    assert kv.num_free_blocks == 1


def test_pool_rejects_taking_more_than_free():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)

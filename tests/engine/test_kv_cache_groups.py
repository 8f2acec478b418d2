"""Layer groups of the KV cache: one pool, a table per group, windows that give blocks back."""

from __future__ import annotations

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_spec import (
    FullAttentionSpec,
    LatentAttentionSpec,
    SlidingWindowSpec,
    make_layout,
)
from engine.request import Request
from engine.sampling_params import SamplingParams

FULL = FullAttentionSpec(2, 16)
WINDOW = SlidingWindowSpec(2, 16, sliding_window=8)
BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=64))


def test_layers_group_by_spec_and_share_tensors_by_position():
    # Gemma 3's pattern: five windowed layers to one global one, twice.
    specs = ([WINDOW] * 5 + [FULL]) * 2
    layout = make_layout(specs)
    assert [len(g.layer_ids) for g in layout.groups] == [2, 2, 2, 2, 2, 2]
    assert [g.spec for g in layout.groups].count(FULL) == 1
    assert len(layout.tensor_shapes) == 2  # two tensors, each used by every group
    full = next(g for g in layout.groups if g.spec == FULL)
    assert full.layer_ids == [5, 11]
    assert [layout.layer_tensor[i] for i in full.layer_ids] == [0, 1]
    # Every (group, tensor) pair is one layer: no two layers of a group share a tensor.
    pairs = {(layout.layer_group[i], layout.layer_tensor[i]) for i in range(12)}
    assert len(pairs) == 12


def test_a_plain_model_is_one_group_with_a_tensor_per_layer():
    layout = make_layout([FULL] * 4)
    assert len(layout.groups) == 1 and layout.layer_tensor == [0, 1, 2, 3]
    assert not layout.has_windows


def test_mixed_page_shapes_fall_back_to_one_full_group():
    layout = make_layout([FullAttentionSpec(2, 16), SlidingWindowSpec(2, 32, sliding_window=8)])
    assert len(layout.groups) == 1 and layout.tensor_shapes == [(2, 16), (2, 32)]
    assert not layout.has_windows


def test_a_latent_layer_keeps_one_576_value_row_per_token():
    """DeepSeek-V3's sizes (61 layers, 128 heads, kv_lora_rank 512, rope 64, nope 128): the
    latent row against per-head K and V of qk_head_dim 192."""
    latent = make_layout([LatentAttentionSpec(512, 64)] * 61)
    per_head = make_layout([FullAttentionSpec(128, 128 + 64)] * 61)
    assert len(latent.groups) == 1 and latent.tensor_shapes == [(576,)] * 61
    assert latent.block_elems == 61 * 576
    assert per_head.block_elems == 61 * 2 * 128 * 192
    assert per_head.block_elems / latent.block_elems == pytest.approx(85.33, abs=0.01)
    kv = KVCacheManager(64, BS, True, latent.groups)
    assert kv.num_blocks_for(100) == 25  # every token kept, as full attention


def decode(kv: KVCacheManager, req: Request, steps: int) -> list[int]:
    """Prefill, then decode ``steps`` tokens; the windowed group's real blocks after each."""
    assert kv.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    held = []
    for i in range(steps):
        req.append_output_token(1000 + i)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        held.append(sum(1 for b in kv.req_to_blocks[req.request_id][1] if b is not kv.null_block))
    return held


def test_a_window_holds_at_most_its_blocks_and_gives_the_rest_back():
    layout = make_layout([FULL, WINDOW])
    kv = KVCacheManager(num_blocks=64, block_size=BS, groups=layout.groups)
    req = make_request("a", list(range(10)))
    held = decode(kv, req, 30)
    bound = -(-(WINDOW.sliding_window - 1) // BS) + 1  # ceil((W - 1) / bs) + 1 = 3
    assert max(held) == bound < -(-req.num_tokens // BS)
    # The full group kept every block; the windowed one its last few, nulls before them.
    full, window = kv.req_to_blocks["a"]
    assert len(full) == len(window) == -(-req.num_tokens // BS)
    assert all(b is not kv.null_block for b in full)
    assert all(b is kv.null_block for b in window[: len(window) - held[-1]])
    # Blocks given back are free for others (null block aside).
    assert kv.num_free_blocks == 64 - 1 - len(full) - held[-1]
    kv.free(req)
    assert kv.num_free_blocks == 63
    assert sum(b.ref_cnt for b in kv.block_pool.blocks) == 1  # the null block alone


def test_the_budget_counts_every_group():
    layout = make_layout([FULL, WINDOW])
    kv = KVCacheManager(num_blocks=64, block_size=BS, groups=layout.groups)
    assert kv.num_blocks_for(4) == 2  # one block in each group
    assert kv.num_blocks_for(100) == 25 + 3  # the window's group stops growing


def test_a_prefix_hit_needs_the_window_blocks_cached():
    layout = make_layout([FULL, WINDOW])
    kv = KVCacheManager(num_blocks=64, block_size=BS, groups=layout.groups)
    system = list(range(16))  # four full blocks
    a = make_request("a", system + [100, 101])
    kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    b = make_request("b", system + [200])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16
    # The full group hits every block; the window only those it reads from position 16 on.
    assert [h.block_id for h in hits[0]] == kv.get_block_ids("a")[0][:4]
    first = WINDOW.first_needed_block(16, BS)
    assert hits[1][:first] == [kv.null_block] * first
    assert [h.block_id for h in hits[1][first:]] == kv.get_block_ids("a")[1][first:4]
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is not None

    # Once the window's blocks are evicted (only the full group's stay cached), no hit that
    # would need them is served.
    kv.free(a)
    kv.free(b)
    for block in kv.block_pool.blocks:
        key = block.block_hash
        if key is not None and key[0] == 1:
            kv.block_pool._evict(block)
    c = make_request("c", system + [300])
    _, num_hit_c = kv.get_computed_blocks(c)
    assert num_hit_c == 0

"""Swap preemption: the cost rule, and the same greedy tokens as recompute and no preemption."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.swap import PreemptionCostModel, SwapSpace
from tests.engine.conftest import CHAT_PROMPTS
from tests.engine.test_scheduler import PER_BLOCK, check_invariants, make_engine

# A 7B-class model on a GPU: 512 KiB of KV per token (16-token blocks of 8 MiB), a 25 GB/s
# host link, 10k prompt tokens/s.
BLOCK_BYTES = 16 * 512 * 2**10
SMOLLM2_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # layers * (k, v) * block * kv_heads * dim * 4
GPU_LIKE = dict(copy_bytes_per_s=25e9, prefill_tokens_per_s=10_000.0)


def test_cost_rule_swaps_a_long_generated_sequence():
    model = PreemptionCostModel(**GPU_LIKE)
    tokens = 3000  # 188 blocks: 2 x 1.58 GB / 25 GB/s = 0.126 s against 0.3 s of prefill
    blocks = -(-tokens // 16)
    assert model.swap_seconds(blocks * BLOCK_BYTES) == pytest.approx(0.1262, abs=1e-3)
    assert model.recompute_seconds(tokens) == pytest.approx(0.3)
    assert model.choose(blocks * BLOCK_BYTES, tokens) == "swap"


def test_cost_rule_recomputes_a_short_prompt():
    model = PreemptionCostModel(**GPU_LIKE)
    # 3 tokens still fill a whole block: 2 x 8 MiB / 25 GB/s = 0.67 ms against 0.3 ms.
    assert model.choose(BLOCK_BYTES, 3) == "recompute"


def test_swap_copies_each_tensor_along_its_block_axis():
    """A K/V tensor ``[2, blocks, ...]`` and a latent cache ``[blocks, block_size, width]`` in
    one space: a request's blocks come back whole into other device blocks."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 6, 4, 2, 8, generator=gen)
    latent = torch.randn(6, 4, 24, generator=gen)
    swap = SwapSpace([kv, latent], 3, block_dims=[1, 0])
    assert swap.bytes_per_block == (2 * 4 * 2 * 8 + 4 * 24) * 4
    assert swap.host_caches[1].shape == (3, 4, 24)
    want_kv, want_latent = kv[:, [1, 3]].clone(), latent[[1, 3]].clone()
    swap.swap_out("r", [1, 3])
    kv.zero_(), latent.zero_()
    swap.swap_in("r", [5, 0])
    assert torch.equal(kv[:, [5, 0]], want_kv) and torch.equal(latent[[5, 0]], want_latent)
    assert kv[:, [1, 2, 3, 4]].abs().sum() == 0 and latent[[1, 2, 3, 4]].abs().sum() == 0
    assert swap.num_free_blocks == 3


def test_prefill_speed_is_a_moving_average():
    model = PreemptionCostModel(copy_bytes_per_s=1e9, prefill_tokens_per_s=500.0)
    model.observe_prefill(1000, 1.0)
    assert model.prefill_tokens_per_s == pytest.approx(0.8 * 500 + 0.2 * 1000)
    model.observe_prefill(0, 1.0)  # nothing to learn from
    assert model.prefill_tokens_per_s == pytest.approx(600.0)


def _run_tiny(folder, **kw):
    engine = make_engine(folder, **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, n in enumerate((16, 16, 4)):
        engine.add_request(str(i), [5 + i] * n, params, arrival_time=float(i))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        check_invariants(engine)
    return engine, tokens


def test_swapped_blocks_return_to_the_pool_and_tokens_match(tiny_llama_dir):
    _, roomy = _run_tiny(tiny_llama_dir, swap_space=0)
    recompute, by_recompute = _run_tiny(tiny_llama_dir, kv_cache_memory=4 * PER_BLOCK, swap_space=0)
    swap, by_swap = _run_tiny(tiny_llama_dir, kv_cache_memory=4 * PER_BLOCK, swap_space=0.01)
    assert by_recompute == by_swap == roomy
    r, s = recompute.get_stats(), swap.get_stats()
    assert r.num_preemptions_recompute > 0 and r.num_preemptions_swap == 0
    assert s.num_preemptions_swap > 0 and s.num_preemptions_recompute == 0
    assert s.num_preemptions == s.num_preemptions_swap
    assert s.swapped_out_bytes >= s.num_preemptions_swap * swap.swap_space.bytes_per_block
    # Every device block back with ref count zero, every host block free again.
    assert s.num_free_blocks == s.num_blocks == 4
    assert all(b.ref_cnt == 0 for b in swap.kv_cache_manager.block_pool.blocks)
    assert swap.swap_space.num_free_blocks == swap.swap_space.num_blocks
    assert s.num_swapped == 0 and s.swap_space_usage == 0.0
    assert s.copy_bytes_per_s > 0 and s.prefill_tokens_per_s > 0


def _run_smollm2(**kw):
    kw.setdefault("kv_cache_memory", 12 * SMOLLM2_BLOCK_BYTES)
    llm = LLM("smollm2", dtype="float32", **kw)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    chats = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS[:8]]
    outs = llm.chat(chats, greedy, use_tqdm=False)
    return llm.stats, [o.outputs[0].token_ids for o in outs]


def test_swap_and_recompute_give_the_unconstrained_greedy_tokens():
    # 8 chats of 40-60 tokens growing by 16 need about 30 blocks; 12 force preemption.
    # swap_space=0 recomputes; with a pool, the cost rule swaps (copying KV on a CPU is far
    # cheaper than prefilling it again).
    stats, unconstrained = _run_smollm2(kv_cache_memory="256MiB")
    assert stats.num_preemptions == 0
    stats, got = _run_smollm2(swap_space=0)
    assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    assert got == unconstrained
    stats, got = _run_smollm2(swap_space=0.25)
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
    assert stats.swapped_out_bytes > 0 and stats.num_swapped == 0
    assert got == unconstrained

"""Prefix-cache keys cannot be forged: a real Python ``hash()`` collision shares no KV."""

from __future__ import annotations

import pytest

from engine.block_pool import hash_block_tokens
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

# Found offline by tests/engine/hash_collision_search.py (seed 0): two different 16-token
# blocks whose tuples have the same Python hash() in every CPython 3.8+ process.
BLOCK_A = [16854, 40824, 19829, 11966, 46734, 11471, 3218, 8756,
           24899, 6488, 47982, 48458, 40536, 12020, 32654, 5591]  # fmt: skip
BLOCK_B = [4133, 13380, 9948, 100, 46734, 11471, 3218, 8756,
           24899, 6488, 47982, 48458, 40536, 12020, 32654, 5591]  # fmt: skip
SUFFIX = [504, 1345, 42, 7]


def test_the_two_blocks_collide_under_python_hash():
    assert BLOCK_A != BLOCK_B
    assert hash(tuple(BLOCK_A)) == hash(tuple(BLOCK_B))
    # The old key, hash((parent, tuple(tokens))), collides for any parent as well.
    assert hash((None, tuple(BLOCK_A))) == hash((None, tuple(BLOCK_B)))


def test_block_keys_differ_and_chain():
    key_a, key_b = hash_block_tokens(None, BLOCK_A), hash_block_tokens(None, BLOCK_B)
    assert key_a != key_b
    assert len(key_a) == 32 and key_a == hash_block_tokens(None, tuple(BLOCK_A))
    # Same tokens under different parents are different prefixes.
    assert hash_block_tokens(key_a, SUFFIX * 4) != hash_block_tokens(key_b, SUFFIX * 4)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(model=tiny_llama_dir, dtype="float32", kv_cache_memory="8MiB")


def run(engine: LLMEngine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_colliding_prompt_gets_no_cached_kv_and_matches_a_cold_run(engine):
    engine.kv_cache_manager.block_pool.reset_prefix_cache()
    cold_b = run(engine, "cold-b", BLOCK_B + SUFFIX)
    engine.kv_cache_manager.block_pool.reset_prefix_cache()

    first_a = run(engine, "a", BLOCK_A + SUFFIX)
    assert first_a.metrics.num_cached_tokens == 0
    again_a = run(engine, "a-again", BLOCK_A + SUFFIX)
    assert again_a.metrics.num_cached_tokens == 16  # the cache works for a true repeat
    b = run(engine, "b", BLOCK_B + SUFFIX)
    assert b.metrics.num_cached_tokens == 0
    assert b.outputs[0].token_ids == cold_b.outputs[0].token_ids

"""Hybrid linear attention (Qwen3.5 / Qwen3.6: Gated DeltaNet layers with a per-sequence state
slot, gated full-attention layers with paged KV) through the engine's regimes: chunked prefill
carries the state from chunk to chunk, preemption drops it (recompute) or moves it (swap),
prefix caching never serves a prefix whose state it does not have, n > 1 and JSON schemas, and
the state memory per sequence does not grow with the context."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.test_architectures import (
    MAX_TOKENS,
    PROMPTS,
    built,
    check_json_schema,
    check_seeded_samples,
    hf_greedy,
    one_thread,  # noqa: F401
    tiny_llm,
    token_ids,
)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Longer than the delta rule's 64-token chunk and than two 16-token blocks.
LONG = [[(7 * i + 3) % 4000 + 5 for i in range(90)]]

HOLDS = ("qwen3_5_text", "qwen3_5_moe_text")  # README's table names this file


@pytest.mark.parametrize("case_id", ["qwen3.5", "qwen3.5-moe"])
def test_regimes_match_hf(tmp_path_factory, case_id):
    """Chunked prefill on a small token budget, preemption by recompute and by swap on a small
    pool, and a repeated prompt give Hugging Face's greedy tokens."""
    folder, expected = built(case_id, tmp_path_factory)
    prompts = PROMPTS + LONG
    expected = expected + hf_greedy(folder, LONG, MAX_TOKENS)
    chunked = tiny_llm(folder, max_num_batched_tokens=8)
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert chunked.stats.num_chunked_prefills > 0

    engine = tiny_llm(folder).llm_engine
    kv = engine.kv_cache_manager
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = kv.num_blocks_for(longest) + 1
    # Two state slots (two running requests), one snapshot, blocks for the longest request.
    state_bytes = 3 * engine.state_cache.bytes_per_slot
    for swap_space, kind in ((0, "recompute"), (0.01, "swap")):
        small = tiny_llm(
            folder,
            kv_cache_memory=num_blocks * engine._kv_bytes_per_block() + state_bytes,
            swap_space=swap_space,
            max_num_seqs=2,
        )
        assert small.llm_engine.state_cache.num_slots == 2
        assert token_ids(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
        stats = small.stats
        assert stats.num_preemptions > 0, kind
        assert getattr(stats, f"num_preemptions_{kind}") > 0
        assert dict(stats.kv_blocks_by_group)["recurrent_state"] == 0  # all given back


@pytest.mark.parametrize("case_id", ["qwen3.5"])
def test_prefix_hit_on_shared_system_prompt(tmp_path_factory, case_id):
    """Two prompts sharing a two-block system prompt: the second starts from the first's
    state snapshot at the block boundary (the hit counted), and both give HF's tokens."""
    folder, _ = built(case_id, tmp_path_factory)
    system = [(11 * i + 5) % 3000 + 7 for i in range(32)]
    prompts = [system + [101, 102, 103, 104, 105], system + [201, 202, 203, 204, 205, 206, 207]]
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    cached = tiny_llm(folder)
    got = [token_ids(cached.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert got == expected
    stats = cached.stats
    assert stats.prefix_cache_hits == 32
    assert cached.llm_engine.state_cache.snapshots  # kept at the system prompt's end
    # A repeated prompt hits its own snapshot too; the long one's chunked prefill as well.
    again = token_ids(cached.generate(prompts[1:], GREEDY, use_tqdm=False))
    assert again == expected[1:] and cached.stats.prefix_cache_hits == 64


def test_seeded_samples_and_json_schema(tmp_path_factory):
    """n > 1 with a seed gives the same samples alone and in a batch; a JSON schema holds."""
    folder, _ = built("qwen3.5", tmp_path_factory)
    llm = tiny_llm(folder)
    check_seeded_samples(llm)
    check_json_schema(llm)


def test_state_memory_per_sequence_is_flat_in_context_length(tmp_path_factory):
    """A running sequence holds one state slot whatever its length; the full-attention layer's
    blocks grow with it."""
    folder, _ = built("qwen3.5", tmp_path_factory)
    engine = tiny_llm(folder).llm_engine
    state = engine.state_cache
    pool_bytes = sum(t.nbytes for t in (*state.conv_states, *state.ssm_states))
    assert pool_bytes == (state.num_slots + state.num_snapshots) * state.bytes_per_slot
    held = {}
    for length in (8, 200):
        engine.add_request(f"r{length}", list(range(5, 5 + length)),
                           SamplingParams(max_tokens=2, ignore_eos=True))  # fmt: skip
        engine.step()
        held[length] = dict(engine.get_stats().kv_blocks_by_group)
        while engine.has_unfinished_requests():
            engine.step()
    assert held[8]["recurrent_state"] == held[200]["recurrent_state"] == 1
    assert held[200]["full_attention"] > 10 * held[8]["full_attention"]
    assert sum(t.nbytes for t in (*state.conv_states, *state.ssm_states)) == pool_bytes
    assert engine.get_stats().kv_blocks_by_group[-1] == ("recurrent_state", 0)


def test_admission_waits_for_a_free_state_slot(tmp_path_factory):
    """With one state slot, requests run one at a time though blocks and max_num_seqs would
    admit more; each still gives HF's tokens and gives its slot back when it finishes."""
    folder, expected = built("qwen3.5", tmp_path_factory)
    probe = tiny_llm(folder).llm_engine
    per_slot = probe.state_cache.bytes_per_slot
    # Half the budget holds one slot and not two; the rest is 5 blocks, enough for every
    # prompt at once (1 + 3 + 1 blocks).
    budget = per_slot + 5 * probe._kv_bytes_per_block()
    llm = tiny_llm(folder, kv_cache_memory=budget, max_num_seqs=4, enable_prefix_caching=False)
    engine = llm.llm_engine
    assert engine.state_cache.num_slots == 1 and engine.kv_cache_manager.num_free_blocks == 5
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    most_running, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == 1
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected
    assert engine.get_stats().kv_blocks_by_group[-1] == ("recurrent_state", 0)

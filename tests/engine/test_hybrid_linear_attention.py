"""Hybrid linear attention (Qwen3.5 / Qwen3.6, OLMo Hybrid, Lara-Mini: Gated DeltaNet layers
with a per-sequence state slot, attention layers with paged KV) through the engine's regimes:
chunked prefill carries the state from chunk to chunk, preemption drops it (recompute) or moves
it (swap), prefix caching never serves a prefix whose state it does not have, n > 1 and JSON
schemas, and the state memory per sequence does not grow with the context."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.hybrid_checks import GREEDY, check_prefix_hit, check_regimes, long_prompt
from tests.engine.test_architectures import (
    PROMPTS,
    built,
    check_json_schema,
    check_seeded_samples,
    one_thread,  # noqa: F401
    tiny_llm,
    token_ids,
)

# Longer than the delta rule's 64-token chunk and than two 16-token blocks.
LONG = [long_prompt(90, vocab=4000)]

# README's table names this file for these types.
HOLDS = ("qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini")


@pytest.mark.parametrize("case_id", ["qwen3.5", "qwen3.5-moe", "olmo-hybrid", "lara-mini"])
def test_regimes_match_hf(tmp_path_factory, case_id):
    """Chunked prefill on a small token budget, preemption by recompute and by swap on a small
    pool give Hugging Face's greedy tokens."""
    check_regimes(*built(case_id, tmp_path_factory), LONG)


@pytest.mark.parametrize("case_id", ["qwen3.5", "olmo-hybrid"])
def test_prefix_hit_on_shared_system_prompt(tmp_path_factory, case_id):
    """The second of two prompts sharing a two-block system prompt starts from the first's
    state snapshot at the block boundary (the hit counted); a repeated prompt hits its own
    snapshot too; every answer is HF's."""
    cached, prompts, expected = check_prefix_hit(built(case_id, tmp_path_factory)[0], 3000)
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

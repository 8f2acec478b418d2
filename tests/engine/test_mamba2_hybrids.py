"""The Mamba-2 hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1) through the engine's regimes:
chunked prefill carries the conv window and the SSM state from chunk to chunk, preemption drops
them (recompute) or moves them (swap), a prefix-cache hit starts from a snapshot, n > 1 and JSON
schemas hold. Their HF-exact greedy tokens per family are CASES rows of test_architectures.py."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.models.mamba2 import Mamba2Mixer
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
LONG = [[(7 * i + 3) % 900 + 5 for i in range(50)]]  # longer than three 16-token blocks
HYBRIDS = ["granite-4.0-h", "nemotron-h", "falcon-h1"]
HOLDS = ("granitemoehybrid", "nemotron_h", "falcon_h1")  # README's table names this file


def test_state_per_sequence_is_conv_window_and_ssm_state(tmp_path_factory):
    """Each Mamba-2 layer keeps ``[conv_dim, kernel - 1]`` and an fp32 ``[heads, head_dim,
    d_state]`` state per sequence; only the attention layer takes KV (Granite: 2 + 1 layers)."""
    folder, _ = built("granite-4.0-h", tmp_path_factory)
    engine = tiny_llm(folder).llm_engine
    mixers = [isinstance(layer.self_attn, Mamba2Mixer) for layer in engine.model.layers]
    assert mixers == [True, False, True]
    assert len(engine.model.kv_cache_specs()) == 1
    state = engine.state_cache
    conv_dim = 128 + 2 * 2 * 8  # x, then B and C of 2 groups of 8
    assert [tuple(t.shape[1:]) for t in state.conv_states] == [(conv_dim, 3)] * 2
    assert [tuple(t.shape[1:]) for t in state.ssm_states] == [(8, 16, 8)] * 2
    assert state.bytes_per_slot == 2 * (conv_dim * 3 + 8 * 16 * 8) * 4


@pytest.mark.parametrize("case_id", HYBRIDS)
def test_regimes_match_hf(tmp_path_factory, case_id):
    """Chunked prefill on a small token budget, preemption by recompute and by swap on a small
    pool give Hugging Face's greedy tokens."""
    folder, expected = built(case_id, tmp_path_factory)
    prompts = PROMPTS + LONG
    expected = expected + hf_greedy(folder, LONG, MAX_TOKENS)
    chunked = tiny_llm(folder, max_num_batched_tokens=8)
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert chunked.stats.num_chunked_prefills > 0

    engine = tiny_llm(folder).llm_engine
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = engine.kv_cache_manager.num_blocks_for(longest) + 1
    state_bytes = 3 * engine.state_cache.bytes_per_slot  # two slots, one snapshot
    for swap_space, kind in ((0, "recompute"), (0.01, "swap")):
        small = tiny_llm(
            folder,
            kv_cache_memory=num_blocks * engine._kv_bytes_per_block() + state_bytes,
            swap_space=swap_space,
            max_num_seqs=2,
        )
        assert small.llm_engine.state_cache.num_slots == 2
        assert token_ids(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert getattr(small.stats, f"num_preemptions_{kind}") > 0, kind


@pytest.mark.parametrize("case_id", ["granite-4.0-h", "falcon-h1"])
def test_prefix_hit_on_shared_system_prompt(tmp_path_factory, case_id):
    """Two prompts sharing a two-block system prompt: the second starts from the first's
    snapshot at the block boundary, and both give HF's tokens."""
    folder, _ = built(case_id, tmp_path_factory)
    system = [(11 * i + 5) % 900 + 7 for i in range(32)]
    prompts = [system + [101, 102, 103, 104, 105], system + [201, 202, 203, 204, 205, 206, 207]]
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    cached = tiny_llm(folder)
    got = [token_ids(cached.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert got == expected
    assert cached.stats.prefix_cache_hits == 32
    assert cached.llm_engine.state_cache.snapshots


@pytest.mark.parametrize("case_id", ["nemotron-h", "falcon-h1"])
def test_seeded_samples_and_json_schema(tmp_path_factory, case_id):
    """n > 1 with a seed gives the same samples alone and in a batch; a JSON schema holds."""
    folder, _ = built(case_id, tmp_path_factory)
    llm = tiny_llm(folder)
    check_seeded_samples(llm)
    check_json_schema(llm)

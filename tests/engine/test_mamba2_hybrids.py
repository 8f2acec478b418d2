"""The Mamba-2 hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1, Zamba2) and a pure Mamba-2 LM
through the engine's regimes: chunked prefill carries the conv window and the SSM state from
chunk to chunk, preemption drops them (recompute) or moves them (swap), a prefix-cache hit
starts from a snapshot, n > 1 and JSON schemas hold. Their HF-exact greedy tokens per family
are CASES rows of test_architectures.py."""

from __future__ import annotations

import pytest

from engine.models.mamba2 import Mamba2Mixer
from tests.engine.hybrid_checks import check_prefix_hit, check_regimes, long_prompt
from tests.engine.test_architectures import (
    built,
    check_json_schema,
    check_seeded_samples,
    one_thread,  # noqa: F401
    tiny_llm,
)

LONG = [long_prompt(50)]  # longer than three 16-token blocks
HYBRIDS = ["granite-4.0-h", "nemotron-h", "falcon-h1", "mamba2", "zamba2"]
# README's table names this file
HOLDS = ("granitemoehybrid", "nemotron_h", "falcon_h1", "mamba2", "zamba2")


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
    check_regimes(*built(case_id, tmp_path_factory), LONG)


def test_a_model_without_attention_keeps_states_and_a_token_count_only(tmp_path_factory):
    """A pure Mamba-2 LM: one block table that counts tokens (one unused value per token), the
    budget to the state slots, and as long a context as its blocks allow for every sequence."""
    folder, _ = built("mamba2", tmp_path_factory)
    llm = tiny_llm(folder, max_num_seqs=4)
    engine = llm.llm_engine
    assert [type(s).__name__ for s in engine.model.kv_cache_specs()] == ["TokenBlocksSpec"]
    assert [tuple(t.shape[2:]) for t in engine.kv_tensors] == [(1,)]
    assert engine.state_cache.num_slots == 4 and len(engine.state_cache.conv_states) == 2
    assert engine.kv_cache_manager.block_pool.num_blocks == 4 * 512 // 16
    assert engine.max_model_len == 512
    assert [kind for kind, _ in llm.stats.kv_blocks_by_group][0] == "token_blocks"


@pytest.mark.parametrize("case_id", ["granite-4.0-h", "falcon-h1", "mamba2", "zamba2"])
def test_prefix_hit_on_shared_system_prompt(tmp_path_factory, case_id):
    """The second of two prompts sharing a two-block system prompt starts from the first's
    snapshot at the block boundary; both give HF's tokens."""
    check_prefix_hit(built(case_id, tmp_path_factory)[0])


@pytest.mark.parametrize("case_id", ["nemotron-h", "falcon-h1"])
def test_seeded_samples_and_json_schema(tmp_path_factory, case_id):
    """n > 1 with a seed gives the same samples alone and in a batch; a JSON schema holds."""
    folder, _ = built(case_id, tmp_path_factory)
    llm = tiny_llm(folder)
    check_seeded_samples(llm)
    check_json_schema(llm)


def test_zamba2_uses_of_a_shared_block_share_its_weights_not_their_kv(tmp_path_factory):
    """Zamba2's three hybrid layers run two shared blocks in turn: the third use runs the first
    block's projections (one tensor, packed once) with adapters of its own, and each use has
    its own paged KV (three attention groups)."""
    folder, _ = built("zamba2", tmp_path_factory)
    model = tiny_llm(folder).llm_engine.model
    first, second, third = (model.layers[i] for i in (1, 2, 4))
    assert third.self_attn.qkv_proj is first.self_attn.qkv_proj
    assert third.feed_forward.down_proj is first.feed_forward.down_proj
    assert second.self_attn.qkv_proj is not first.self_attn.qkv_proj
    assert third.self_attn.adapters is not first.self_attn.adapters
    assert len(model.kv_cache_specs()) == 3

"""Kimi Linear (KDA layers with a conv window and an fp32 state slot per sequence, a NoPE
latent-attention layer with one cached row per token, experts) through the engine's regimes:
chunked prefill carries the KDA state from chunk to chunk, preemption drops it (recompute) or
moves it (swap), a prefix-cache hit starts from a snapshot, n > 1 and JSON schemas hold."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache_spec import LatentAttentionSpec
from engine.models.kimi_linear import KimiDeltaAttention
from engine.models.latent_attention import LatentAttention
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
# Past five 16-token blocks, and past one 64-token chunk of the KDA prefill form.
LONG = [[(7 * i + 3) % 4000 + 5 for i in range(70)]]


def test_kda_layers_keep_a_state_and_mla_one_latent_row(tmp_path_factory):
    """Each KDA layer keeps the q/k/v conv window and a [heads, head_dim, head_dim] fp32 state;
    the MLA layer alone takes paged blocks, of one latent row per token."""
    folder, _ = built("kimi-linear", tmp_path_factory)
    llm = tiny_llm(folder)
    engine = llm.llm_engine
    kinds = [type(layer.self_attn) for layer in engine.model.layers]
    assert kinds == [KimiDeltaAttention, LatentAttention, KimiDeltaAttention]
    assert engine.model.kv_cache_specs() == [LatentAttentionSpec(32, 16)]
    assert [kind for kind, _ in llm.stats.kv_blocks_by_group] == [
        "latent_attention",
        "recurrent_state",
    ]
    state = engine.state_cache
    assert [tuple(t.shape[1:]) for t in state.conv_states] == [(3 * 64, 3)] * 2
    assert [tuple(t.shape[1:]) for t in state.ssm_states] == [(4, 16, 16)] * 2
    assert state.bytes_per_slot == 2 * (3 * 64 * 3 + 4 * 16 * 16) * 4  # fp32


def test_regimes_match_hf(tmp_path_factory):
    """Chunked prefill on a small token budget, preemption by recompute and by swap on a small
    pool give Hugging Face's greedy tokens."""
    folder, expected = built("kimi-linear", tmp_path_factory)
    prompts = PROMPTS + LONG
    expected = expected + hf_greedy(folder, LONG, MAX_TOKENS)
    assert token_ids(tiny_llm(folder).generate(prompts, GREEDY, use_tqdm=False)) == expected
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
        stats = small.stats
        assert getattr(stats, f"num_preemptions_{kind}") > 0, kind
        assert dict(stats.kv_blocks_by_group)["recurrent_state"] == 0  # all given back


def test_prefix_hit_on_shared_system_prompt(tmp_path_factory):
    """Two prompts sharing a two-block system prompt: the second starts from the first's KDA
    snapshot at the block boundary and the first's latent rows (the hit counted), and both give
    HF's tokens."""
    folder, _ = built("kimi-linear", tmp_path_factory)
    system = [(11 * i + 5) % 3000 + 7 for i in range(32)]
    prompts = [system + [101, 102, 103, 104, 105], system + [201, 202, 203, 204, 205, 206, 207]]
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    cached = tiny_llm(folder)
    got = [token_ids(cached.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert got == expected
    assert cached.stats.prefix_cache_hits == 32
    assert cached.llm_engine.state_cache.snapshots


def test_seeded_samples_and_json_schema(tmp_path_factory):
    """n > 1 with a seed gives the same samples alone and in a batch; a JSON schema holds."""
    folder, _ = built("kimi-linear", tmp_path_factory)
    llm = tiny_llm(folder)
    check_seeded_samples(llm)
    check_json_schema(llm)


@pytest.mark.slow
def test_two_ranks_split_kda_by_heads(tmp_path_factory):
    """At two ranks each KDA layer holds half the heads (and half their state) and the greedy
    tokens are still Hugging Face's."""
    folder, expected = built("kimi-linear", tmp_path_factory)
    with LLM(
        str(folder), dtype="float32", block_size=16, kv_cache_memory=2**22, tensor_parallel_size=2
    ) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        state = llm.llm_engine.state_cache
        assert [tuple(t.shape[1:]) for t in state.ssm_states] == [(2, 16, 16)] * 2

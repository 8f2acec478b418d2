"""Kimi Linear (KDA layers with a conv window and an fp32 state slot per sequence, a NoPE
latent-attention layer with one cached row per token, experts) through the engine's regimes (Ling
3, ``bailing_hybrid``, the same mixers with its latent attention rotated and gated per head,
through the regimes and two ranks):
chunked prefill carries the KDA state from chunk to chunk, preemption drops it (recompute) or
moves it (swap), a prefix-cache hit starts from a snapshot, n > 1 and JSON schemas hold."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.kv_cache_spec import LatentAttentionSpec
from engine.models.kimi_linear import KimiDeltaAttention
from engine.models.latent_attention import LatentAttention
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

# Past five 16-token blocks, and past one 64-token chunk of the KDA prefill form.
LONG = [long_prompt(70, vocab=4000)]
KDA_FAMILIES = ["kimi-linear", "ling-hybrid"]


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


@pytest.mark.parametrize("family", KDA_FAMILIES)
def test_regimes_match_hf(family, tmp_path_factory):
    """Unchunked, chunked prefill on a small token budget, preemption by recompute and by swap
    on a small pool give Hugging Face's greedy tokens."""
    folder, expected = built(family, tmp_path_factory)
    assert token_ids(tiny_llm(folder).generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    check_regimes(folder, expected, LONG)


def test_prefix_hit_on_shared_system_prompt(tmp_path_factory):
    """The second of two prompts sharing a two-block system prompt starts from the first's KDA
    snapshot and latent rows (the hit counted); both give HF's tokens."""
    check_prefix_hit(built("kimi-linear", tmp_path_factory)[0], vocab=3000)


def test_seeded_samples_and_json_schema(tmp_path_factory):
    """n > 1 with a seed gives the same samples alone and in a batch; a JSON schema holds."""
    folder, _ = built("kimi-linear", tmp_path_factory)
    llm = tiny_llm(folder)
    check_seeded_samples(llm)
    check_json_schema(llm)


@pytest.mark.slow
@pytest.mark.parametrize("family", KDA_FAMILIES)
def test_two_ranks_split_kda_by_heads(family, tmp_path_factory):
    """At two ranks each KDA layer holds half the heads (and half their state) and the greedy
    tokens are still Hugging Face's."""
    folder, expected = built(family, tmp_path_factory)
    with LLM(
        str(folder), dtype="float32", block_size=16, kv_cache_memory=2**22, tensor_parallel_size=2
    ) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        state = llm.llm_engine.state_cache
        assert [tuple(t.shape[1:]) for t in state.ssm_states] == [(2, 16, 16)] * 2

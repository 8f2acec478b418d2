"""LFM2 and LFM3 (gated short convolutions with a conv state slot per sequence, attention layers
with paged KV: LFM3's sliding ones give blocks back) through the engine's regimes: chunked
prefill carries the conv window from chunk to chunk, preemption drops it (recompute) or moves it
(swap), a prefix-cache hit starts from a snapshot, n > 1 and JSON schemas hold."""

from __future__ import annotations

import pytest

from engine.models.lfm2 import ShortConv
from tests.engine.hybrid_checks import check_prefix_hit, check_regimes, long_prompt
from tests.engine.test_architectures import (
    built,
    check_json_schema,
    check_seeded_samples,
    one_thread,  # noqa: F401
    tiny_llm,
)

LONG = [long_prompt(50, vocab=4000)]  # longer than three 16-token blocks
HOLDS = ("lfm2", "lfm3")  # README's table names this file


def test_conv_layers_keep_only_a_conv_window(tmp_path_factory):
    """Each conv layer's state is its last ``L_cache - 1`` inputs per channel, nothing more;
    the attention layer alone takes a KV cache."""
    folder, _ = built("lfm2", tmp_path_factory)
    engine = tiny_llm(folder).llm_engine
    convs = [layer.self_attn for layer in engine.model.layers]
    assert [isinstance(m, ShortConv) for m in convs] == [True, False, True, True]
    assert len(engine.model.kv_cache_specs()) == 1
    state = engine.state_cache
    assert [tuple(t.shape[1:]) for t in state.conv_states] == [(64, 2)] * 3
    assert state.bytes_per_slot == 3 * 64 * 2 * 4  # fp32, no recurrent state


def test_lfm3_windows_keep_a_group_of_their_own(tmp_path_factory):
    """LFM3's sliding layer and full layer take one KV group each (the window's blocks go back
    as it moves on); its conv layers take state slots only."""
    folder, _ = built("lfm3", tmp_path_factory)
    llm = tiny_llm(folder)
    assert [kind for kind, _ in llm.stats.kv_blocks_by_group][:2] == [
        "sliding_window=8",
        "full_attention",
    ]
    assert len(llm.llm_engine.state_cache.conv_states) == 2


@pytest.mark.parametrize("case_id", ["lfm2", "lfm3"])
def test_regimes_match_hf(tmp_path_factory, case_id):
    """Chunked prefill on a small token budget, preemption by recompute and by swap on a small
    pool give Hugging Face's greedy tokens."""
    check_regimes(*built(case_id, tmp_path_factory), LONG)


@pytest.mark.parametrize("case_id", ["lfm2", "lfm3"])
def test_prefix_hit_on_shared_system_prompt(tmp_path_factory, case_id):
    """The second of two prompts sharing a two-block system prompt starts from the first's conv
    snapshot at the block boundary (the hit counted); both give HF's tokens."""
    check_prefix_hit(built(case_id, tmp_path_factory)[0], vocab=3000)


@pytest.mark.parametrize("case_id", ["lfm2", "lfm3"])
def test_seeded_samples_and_json_schema(tmp_path_factory, case_id):
    """n > 1 with a seed gives the same samples alone and in a batch; a JSON schema holds."""
    folder, _ = built(case_id, tmp_path_factory)
    llm = tiny_llm(folder)
    check_seeded_samples(llm)
    check_json_schema(llm)

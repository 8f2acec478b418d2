"""Mamba-1 families (``mamba``, ``falcon_mamba``, Jamba's hybrid) through the engine's regimes:
the per-channel SSM state ``[channels, 1, state_dim]`` and the conv window carried through
chunked prefill, dropped by recompute or moved by swap, restored from a snapshot on a prefix
hit; n > 1 and JSON schemas hold. Their HF-exact greedy tokens are CASES rows of
test_architectures.py."""

from __future__ import annotations

import pytest

from engine.models.mamba1 import MambaMixer
from tests.engine.hybrid_checks import check_prefix_hit, check_regimes, long_prompt
from tests.engine.test_architectures import (
    built,
    check_json_schema,
    check_seeded_samples,
    one_thread,  # noqa: F401
    tiny_llm,
)

LONG = [long_prompt(50)]  # longer than three 16-token blocks
FAMILIES = ["mamba", "falcon-mamba", "jamba"]
HOLDS = ("mamba", "falcon_mamba", "jamba")  # README's table names this file


def test_state_per_sequence_is_conv_window_and_a_state_per_channel(tmp_path_factory):
    """Jamba (5 layers, attention at 1 and 3): each of the three Mamba-1 layers keeps
    ``[channels, kernel - 1]`` and an fp32 ``[channels, 1, state_dim]`` per sequence; the two
    attention layers take paged KV."""
    folder, _ = built("jamba", tmp_path_factory)
    engine = tiny_llm(folder).llm_engine
    mixers = [isinstance(layer.self_attn, MambaMixer) for layer in engine.model.layers]
    assert mixers == [True, False, True, False, True]
    assert len(engine.model.kv_cache_specs()) == 2
    state = engine.state_cache
    channels = 2 * 64  # mamba_expand x hidden_size
    assert [tuple(t.shape[1:]) for t in state.conv_states] == [(channels, 3)] * 3
    assert [tuple(t.shape[1:]) for t in state.ssm_states] == [(channels, 1, 8)] * 3
    assert state.bytes_per_slot == 3 * (channels * 3 + channels * 8) * 4


@pytest.mark.parametrize("case_id", FAMILIES)
def test_regimes_match_hf(tmp_path_factory, case_id):
    """Chunked prefill on a small token budget, preemption by recompute and by swap on a small
    pool give Hugging Face's greedy tokens."""
    check_regimes(*built(case_id, tmp_path_factory), LONG)


@pytest.mark.parametrize("case_id", ["mamba", "jamba"])
def test_prefix_hit_on_shared_system_prompt(tmp_path_factory, case_id):
    """The second of two prompts sharing a two-block system prompt starts from the first's
    snapshot at the block boundary; both give HF's tokens."""
    check_prefix_hit(built(case_id, tmp_path_factory)[0])


def test_seeded_samples_and_json_schema(tmp_path_factory):
    """Jamba: n > 1 with a seed gives the same samples alone and in a batch; a JSON schema
    holds."""
    llm = tiny_llm(built("jamba", tmp_path_factory)[0])
    check_seeded_samples(llm)
    check_json_schema(llm)

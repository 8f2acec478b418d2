"""MiniMax's lightning attention (a linear attention whose ``[heads, head_dim, head_dim]`` state
decays at a fixed rate per head) beside full attention, through the engine's regimes: the state
carried through chunked prefill, dropped by recompute or moved by swap, restored from a snapshot
on a prefix hit; n > 1 and JSON schemas hold. Its HF-exact greedy tokens are a CASES row of
test_architectures.py."""

from __future__ import annotations

import torch

from engine.models.minimax import LightningAttention, lightning_slopes
from tests.engine.hybrid_checks import check_prefix_hit, check_regimes, long_prompt
from tests.engine.test_architectures import (
    built,
    check_json_schema,
    check_seeded_samples,
    one_thread,  # noqa: F401
    tiny_llm,
)

HOLDS = ("minimax",)  # README's table names this file


def test_lightning_layers_keep_a_decaying_state_and_no_kv(tmp_path_factory):
    """Three lightning layers: an fp32 ``[4, 16, 16]`` state per sequence each, no conv window,
    their slopes transformers' per layer; the one full-attention layer takes paged KV."""
    folder, _ = built("minimax", tmp_path_factory)
    engine = tiny_llm(folder).llm_engine
    kinds = [isinstance(layer.self_attn, LightningAttention) for layer in engine.model.layers]
    assert kinds == [True, False, True, True]
    assert len(engine.model.kv_cache_specs()) == 1
    assert [tuple(t.shape[1:]) for t in engine.state_cache.ssm_states] == [(4, 16, 16)] * 3
    assert engine.state_cache.bytes_per_slot == 3 * 4 * 16 * 16 * 4
    slopes = {i: layer.self_attn.slope for i, layer in enumerate(engine.model.layers) if kinds[i]}
    assert [torch.equal(s, lightning_slopes(4, i, 4)) for i, s in slopes.items()] == [True] * 3
    assert slopes[3][0] < slopes[2][0] < slopes[0][0]  # later layers decay more slowly


def test_regimes_match_hf(tmp_path_factory):
    """Chunked prefill on a small token budget, preemption by recompute and by swap on a small
    pool give Hugging Face's greedy tokens."""
    check_regimes(*built("minimax", tmp_path_factory), [long_prompt(50)])


def test_prefix_hit_seeded_samples_and_json_schema(tmp_path_factory):
    """A two-block system prompt hit from a snapshot gives HF's tokens; n > 1 with a seed gives
    the same samples alone and in a batch; a JSON schema holds."""
    llm, _, _ = check_prefix_hit(built("minimax", tmp_path_factory)[0])
    check_seeded_samples(llm)
    check_json_schema(llm)

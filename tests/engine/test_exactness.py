"""Greedy fp32 output of the engine equals Hugging Face, token for token, under every regime."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import MAX_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def run(chat_prompt_ids, **engine_kwargs):
    engine_kwargs.setdefault("kv_cache_memory", "256MiB")
    llm = LLM("smollm2", dtype="float32", **engine_kwargs)
    outs = llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_roomy_pool_matches_hf(chat_prompt_ids, hf_reference):
    llm, got = run(chat_prompt_ids)
    assert got == hf_reference
    assert llm.stats.num_preemptions == 0
    assert llm.stats.kv_cache_usage == 0.0  # every block returned


def test_tiny_pool_preempts_and_still_matches_hf(chat_prompt_ids, hf_reference):
    # 16 prompts of ~40-70 tokens need ~90 blocks of 16 at the end; give 24 blocks.
    llm, got = run(chat_prompt_ids, kv_cache_memory=24 * 30 * 2 * 16 * 3 * 64 * 4)
    assert llm.stats.num_blocks == 24
    assert llm.stats.num_preemptions > 0
    assert got == hf_reference


def test_prefix_caching_off_matches_hf(chat_prompt_ids, hf_reference):
    llm, got = run(chat_prompt_ids, enable_prefix_caching=False)
    assert llm.stats.prefix_cache_hit_rate == 0.0
    assert got == hf_reference


def test_chunked_prefill_matches_hf(chat_prompt_ids, hf_reference):
    longest = max(len(p) for p in chat_prompt_ids)
    budget = longest // 3
    llm, got = run(chat_prompt_ids, max_num_batched_tokens=budget)
    assert got == hf_reference
    assert llm.stats.num_chunked_prefills > 0


@pytest.mark.parametrize("prompt", ["The capital of France is", [1, 504, 3458, 282]])
def test_raw_prompt_and_token_ids(hf_smollm2, prompt):
    from tests.engine.conftest import hf_greedy

    model, tok = hf_smollm2
    llm = LLM("smollm2", dtype="float32", kv_cache_memory="64MiB")
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(model, ids, 12)

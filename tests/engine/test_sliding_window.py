"""A model with sliding-window layers: Hugging Face's tokens, and a windowed group that holds
only its window's blocks (while the full-attention layers keep everything)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from engine import LLMEngine, SamplingParams
from engine.kv_cache_spec import SlidingWindowSpec
from tests.engine.test_scheduler import check_invariants

WINDOW, BS = 16, 8
WINDOW_BLOCKS = -(-(WINDOW - 1) // BS) + 1  # ceil((W - 1) / bs) + 1 = 3
PROMPTS = [[5 + i for i in range(n)] for n in (40, 19, 29)]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def qwen2_window(tmp_path_factory):
    """Qwen2 with layer 0 full and layer 1 windowed (use_sliding_window, max_window_layers=1)."""
    folder = tmp_path_factory.mktemp("qwen2-window")
    return make_tiny_model(
        folder, "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )


def hf_tokens(folder, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(qwen2_window):
    return {str(i): hf_tokens(qwen2_window, p) for i, p in enumerate(PROMPTS)}


def run(folder, **kw):
    """Every prompt to the end; the most blocks the windowed group held for one request while
    it decoded, and the engine."""
    kw.setdefault("kv_cache_memory", 2**21)
    engine = LLMEngine(model=folder, dtype="float32", block_size=BS, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params, arrival_time=float(i))
    kv, tokens, most = engine.kv_cache_manager, {}, 0
    window_group = next(
        g for g, group in enumerate(kv.groups) if isinstance(group.spec, SlidingWindowSpec)
    )
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        check_invariants(engine)
        for request in engine.scheduler.running:
            if request.num_computed_tokens > request.num_prompt_tokens:  # decoding
                blocks = kv.req_to_blocks[request.request_id][window_group]
                most = max(most, sum(1 for b in blocks if b is not kv.null_block))
    return tokens, most, engine


def test_windowed_layers_match_hf_and_hold_only_their_window(qwen2_window, expected):
    tokens, most, engine = run(qwen2_window)
    assert tokens == expected
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    assert most == WINDOW_BLOCKS < -(-longest // BS)
    kinds = [kind for kind, _ in engine.get_stats().kv_blocks_by_group]
    assert kinds == ["full_attention", f"sliding_window={WINDOW}"]


def test_chunked_prefill_and_preemption_keep_the_tokens(qwen2_window, expected):
    chunked, _, _ = run(qwen2_window, max_num_batched_tokens=8)
    assert chunked == expected
    # A pool too small for all three at once: preemption by recompute, then by swap.
    # One tensor serves both groups: k and v, block, kv heads, head dim, fp32. Each request
    # needs 8 full blocks and 3 windowed ones at most; 23 blocks hold two, not three.
    per_block = 2 * BS * 2 * 16 * 4
    small = dict(kv_cache_memory=23 * per_block)
    recomputed, _, engine = run(qwen2_window, swap_space=0, **small)
    assert recomputed == expected and engine.get_stats().num_preemptions_recompute > 0
    swapped, _, engine = run(qwen2_window, swap_space=0.01, **small)
    stats = engine.get_stats()
    assert swapped == expected and stats.num_preemptions_swap > 0
    assert engine.swap_space.num_free_blocks == engine.swap_space.num_blocks


def test_prefix_hit_on_a_shared_prompt_serves_the_same_tokens(qwen2_window):
    engine = LLMEngine(model=qwen2_window, dtype="float32", block_size=BS, kv_cache_memory=2**21)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    system = list(range(40, 88))  # six full blocks
    outs = {}
    for rid in ("cold", "warm"):
        engine.add_request(rid, system + [7, 8, 9], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[rid] = out
    assert outs["warm"].metrics.num_cached_tokens == 48
    assert outs["warm"].outputs[0].token_ids == outs["cold"].outputs[0].token_ids
    assert outs["cold"].outputs[0].token_ids == hf_tokens(qwen2_window, system + [7, 8, 9])


def test_a_prompt_too_big_to_prefill_whole_is_prefilled_chunk_by_chunk(qwen2_window):
    """52 tokens prefilled at once take 7 full and 7 windowed blocks; the pool has 12 and a null
    block, enough for the 72 tokens at the end (9 full blocks, 3 windowed). Each chunk lets
    the window give blocks back, so the prompt runs in smaller chunks instead of waiting or
    preempting itself forever, and still gives HF's tokens."""
    prompt = [7 + i for i in range(52)]
    per_block = 2 * BS * 2 * 16 * 4  # one tensor for both groups, as above
    engine = LLMEngine(
        model=qwen2_window, dtype="float32", block_size=BS, kv_cache_memory=13 * per_block,
        max_num_seqs=1,
    )  # fmt: skip
    assert engine.get_stats().num_blocks == 13 and engine.max_model_len == 72
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("long", prompt, params)
    tokens = None
    for _ in range(200):  # a prompt that never fits would loop here without end
        for out in engine.step():
            tokens = out.outputs[0].token_ids if out.finished else tokens
        if not engine.has_unfinished_requests():
            break
    assert tokens == hf_tokens(qwen2_window, prompt)
    assert engine.get_stats().num_chunked_prefills > 0

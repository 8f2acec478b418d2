"""What every hybrid family's regime tests check (test_hybrid_linear_attention.py, test_lfm2.py,
test_mamba2_hybrids.py, test_kimi_linear.py): per-sequence states carried through chunked
prefill, dropped by recompute or moved by swap on a pool of two slots, and restored from a
snapshot on a prefix hit, every time with Hugging Face's greedy tokens."""

from __future__ import annotations

from engine import SamplingParams
from tests.engine.test_architectures import MAX_TOKENS, PROMPTS, hf_greedy, tiny_llm, token_ids

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def long_prompt(length: int, vocab: int = 900) -> list[int]:
    """A prompt of ``length`` token ids below ``vocab`` + 5."""
    return [(7 * i + 3) % vocab + 5 for i in range(length)]


def check_regimes(folder, expected: list[list[int]], long_prompts: list[list[int]]) -> None:
    """PROMPTS (whose HF tokens are ``expected``) and ``long_prompts``: chunked prefill on an
    8-token budget, then preemption by recompute and by swap with two state slots and one
    snapshot give HF's greedy tokens, the preemption counted and every slot given back."""
    prompts = PROMPTS + long_prompts
    expected = expected + hf_greedy(folder, long_prompts, MAX_TOKENS)
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


def check_prefix_hit(folder, vocab: int = 900):
    """Two prompts sharing a two-block (32-token) system prompt: the second starts from the
    first's state snapshot at the block boundary (32 tokens hit), both with HF's tokens.
    Returns the engine and the prompts with their tokens, for more checks."""
    system = [(11 * i + 5) % vocab + 7 for i in range(32)]
    prompts = [system + [101, 102, 103, 104, 105], system + [201, 202, 203, 204, 205, 206, 207]]
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    cached = tiny_llm(folder)
    got = [token_ids(cached.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert got == expected
    assert cached.stats.prefix_cache_hits == 32
    assert cached.llm_engine.state_cache.snapshots  # kept at the system prompt's end
    return cached, prompts, expected

"""Sampler and request-level behaviour: seeds, filters, penalties, stops, n, logprobs, errors."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sampler import Sampler, _top_k_top_p


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=2**24)


PROMPTS = [[1, 2 + i, 30 + i, 400 + 7 * i, 9] for i in range(16)]


def test_seeded_sampling_same_alone_and_in_a_batch_of_16(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.3, max_tokens=16, ignore_eos=True)
    params = [others] * 16
    params[3] = seeded
    batch = llm.generate(PROMPTS, params, use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    # The unseeded neighbours really sampled (not all greedy twins of each other).
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) > 8


def test_different_seeds_differ(llm):
    outs = [
        llm.generate(
            [PROMPTS[0]], SamplingParams(seed=s, max_tokens=16, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
        for s in (1, 2)
    ]
    assert outs[0] != outs[1]


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(
        PROMPTS[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    topk1 = llm.generate(
        PROMPTS[:4],
        SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = _top_k_top_p(logits, top_k=[0, 2], top_p=[0.7, 1.0])
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True, True, False, False]]


def test_min_p_and_penalties_in_sampler():
    sampler = Sampler(torch.device("cpu"))
    req = Request("r", [3, 3, 1], SamplingParams(temperature=0, repetition_penalty=2.0))
    logits = torch.tensor([[1.0, 1.9, 0.0, 2.0]])
    # Tokens 3 and 1 were seen: 2.0 / 2 = 1.0 and 1.9 / 2 = 0.95, so unseen token 0 wins.
    tokens, _ = sampler(logits, [req], eos_ids=set())
    assert tokens == [0]
    req2 = Request(
        "q", [0], SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5)
    )
    req2.append_output_token(3)
    req2.append_output_token(3)
    # Token 3 seen twice: 1.5 - 1.0 (presence) - 2 * 0.5 (frequency) = -0.5 < 0.
    tokens, _ = sampler(torch.tensor([[0.0, -1.0, -1.0, 1.5]]), [req2], eos_ids=set())
    assert tokens == [0]
    req3 = Request("m", [0], SamplingParams(temperature=1.0, min_p=0.5, seed=0))
    probs_logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]]))
    seen = {sampler(probs_logits, [req3], eos_ids=set())[0][0] for _ in range(50)}
    assert seen == {0}


def test_min_tokens_and_stop_token_ids(llm):
    base = (
        llm.generate(
            [PROMPTS[0]],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    stop_tok = base[2]
    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    first = base.index(stop_tok)
    assert out.outputs[0].token_ids == base[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    forced = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    assert stop_tok not in forced.outputs[0].token_ids[:6]


def test_stop_string_is_cut_from_text(llm):
    base = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    out = llm.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = list(range(100, 164))  # 4 full blocks
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine = llm.llm_engine
    hits_before = engine.kv_cache_manager.prefix_cache_hits
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    # Samples 1..3 reuse the 3 full blocks of the prompt that precede its last token.
    assert engine.kv_cache_manager.prefix_cache_hits - hits_before >= 3 * 48


def test_logprobs_top_k(llm):
    out = llm.generate(
        [PROMPTS[2]],
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3  # greedy token is the top-1, so it is among the 3
        assert max(lp.values()) == lp[tok] <= 0
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs))
    )


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_the_engine_clean(llm):
    engine = llm.llm_engine
    good = llm.generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    too_long = [5] * (engine.max_model_len + 1)
    for bad, match in [
        ("", "prompts\\[1\\]: prompt must not be empty"),
        (too_long, "max_model_len"),
        ([10**9], "token ids"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([PROMPTS[0], bad], SamplingParams(max_tokens=5), use_tqdm=False)
        assert not engine.has_unfinished_requests()
    again = llm.generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in good]


def test_unknown_model_name_is_refused():
    with pytest.raises(ValueError, match="unknown"):
        LLM("no-such-model")


def test_outputs_in_input_order_and_stats(llm):
    lens = [9, 2, 5, 1]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    assert [o.prompt_token_ids for o in outs] == PROMPTS[:4]
    s = llm.stats
    assert s.num_steps > 0 and s.num_generated_tokens >= sum(lens) and s.kv_cache_usage == 0.0

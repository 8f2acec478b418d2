"""The engine on the C++ CPU kernels gives the torch backend's tokens; a bf16 KV cache works."""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from kernels.cpu_attention import cpu_kernels_available

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the C++ CPU kernels cannot be built here"
)

PREFIX = (
    "You are a terse assistant for a geography quiz. Answer every question in one short "
    "sentence, never more, and do not repeat the question back to the user. "
)
PROMPTS = [PREFIX + "What is the capital of France?", "Hi", PREFIX + "Name a prime number."]


def _generate(model: str, backend: str, kv_cache_dtype: str = "auto"):
    # A small token budget chunks the prompts and a shared prefix gives prefix-cache hits, so
    # steps mix prompt chunks with cached context and decodes.
    engine = LLMEngine(
        EngineConfig(
            model=model, device="cpu", dtype="float32", block_size=16, max_num_seqs=4,
            max_num_batched_tokens=24, kv_cache_memory="4MiB", attention_backend=backend,
            kv_cache_dtype=kv_cache_dtype,
        )
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    engine.add_request("0", PROMPTS[0], params)
    engine.add_request("1", PROMPTS[1], params)
    finished, num_steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
        num_steps += 1
        if num_steps == 4:  # request 0's prompt blocks are cached by now
            engine.add_request("2", PROMPTS[2], params)
    assert engine.get_stats().prefix_cache_hit_rate > 0
    return engine, [finished[str(i)] for i in range(len(PROMPTS))]


def _assert_same(actual, expected, abs_tol: float) -> None:
    assert [list(c.token_ids) for c in actual] == [list(c.token_ids) for c in expected]
    for got, want in zip(actual, expected, strict=True):
        for got_step, want_step in zip(got.logprobs, want.logprobs, strict=True):
            assert got_step.keys() == want_step.keys()
            for token_id, logprob in want_step.items():
                assert _value(got_step[token_id]) == pytest.approx(_value(logprob), abs=abs_tol)


def test_auto_runs_the_cpu_kernels_and_gives_the_torch_tokens(tiny_llama_dir):
    _, expected = _generate(tiny_llama_dir, "torch")
    engine, actual = _generate(tiny_llama_dir, "auto")
    attn = engine.model.layers[0].self_attn.attn
    assert attn.resolve(torch.device("cpu")) == "cpu"
    assert all(len(c.token_ids) == 12 for c in expected)
    _assert_same(actual, expected, 1e-4)


def test_bf16_kv_cache_under_an_fp32_model(tiny_llama_dir):
    """Both backends store and read bf16 K/V and agree on the tokens; the cache is bf16.

    Logprobs agree to a bf16 rounding step, not to fp32's: a last-bit difference in a hidden
    state can round a later layer's K/V to the neighbouring bf16 value.
    """
    _, expected = _generate(tiny_llama_dir, "torch", "bfloat16")
    engine, actual = _generate(tiny_llama_dir, "cpu", "bfloat16")
    assert all(c.dtype == torch.bfloat16 for c in engine.kv_caches)
    assert engine.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    _assert_same(actual, expected, 1e-2)


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="attention_backend='cuda'"):
        EngineConfig(attention_backend="cuda")


def _value(logprob) -> float:
    return float(getattr(logprob, "logprob", logprob))

"""The engine gives the same greedy tokens (and logprobs) on the Triton backend as on torch."""

import pytest

import kernels.triton_attention
import kernels.triton_kv_write
from engine import EngineConfig, LLMEngine, SamplingParams


def _generate(model: str, backend: str) -> list:
    # A small token budget chunks the prompts and a shared prefix gives prefix-cache hits, so
    # steps mix prompt chunks with cached context and decodes.
    engine = LLMEngine(
        EngineConfig(
            model=model, device="cpu", dtype="float32", block_size=16, max_num_seqs=4,
            max_num_batched_tokens=24, kv_cache_memory="4MiB", attention_backend=backend,
        )
    )  # fmt: skip
    prefix = (
        "You are a terse assistant for a geography quiz. Answer every question in one short "
        "sentence, never more, and do not repeat the question back to the user. "
    )
    prompts = [prefix + "What is the capital of France?", "Hi", prefix + "Name a prime number."]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    engine.add_request("0", prompts[0], params)
    engine.add_request("1", prompts[1], params)
    finished = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
        num_steps += 1
        if num_steps == 4:  # request 0's prompt blocks are cached by now
            engine.add_request("2", prompts[2], params)
    assert engine.get_stats().prefix_cache_hit_rate > 0
    return [finished[str(i)] for i in range(len(prompts))]


def test_triton_backend_gives_the_torch_backend_tokens(tiny_llama_dir, monkeypatch):
    expected = _generate(tiny_llama_dir, "torch")

    calls = {"write_kv": 0, "attention": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        kernels.triton_kv_write, "write_kv_triton",
        counted("write_kv", kernels.triton_kv_write.write_kv_triton),
    )  # fmt: skip
    monkeypatch.setattr(
        kernels.triton_attention, "unified_attention_triton",
        counted("attention", kernels.triton_attention.unified_attention_triton),
    )  # fmt: skip
    actual = _generate(tiny_llama_dir, "triton")

    assert calls["write_kv"] > 0 and calls["attention"] == calls["write_kv"]
    assert [list(c.token_ids) for c in actual] == [list(c.token_ids) for c in expected]
    assert all(len(c.token_ids) == 12 for c in expected)
    # The top-3 logprobs of every step too: far more sensitive than the argmax alone.
    for got, want in zip(actual, expected, strict=True):
        for got_step, want_step in zip(got.logprobs, want.logprobs, strict=True):
            assert got_step.keys() == want_step.keys()
            for token_id, logprob in want_step.items():
                assert _value(got_step[token_id]) == pytest.approx(_value(logprob), abs=1e-4)


def _value(logprob) -> float:
    return float(getattr(logprob, "logprob", logprob))

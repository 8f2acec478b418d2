"""A step that raises fails only its culprit; the other requests' greedy tokens are unchanged."""

from __future__ import annotations

import pytest

from engine.llm_engine import FAULT_ENV, FAULT_MARKER, LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "List three primary colors:",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1492, Columbus",
    "Water boils at",
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "1")
        return LLMEngine(model=tiny_llama_dir, dtype="float32", kv_cache_memory="8MiB")


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]):
    """Add every request, step to the end; (final outputs by id, failed ids with errors)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals, failed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        failed.update(engine.pop_failed_requests())
    engine.kv_cache_manager.block_pool.reset_prefix_cache()
    return finals, failed


@pytest.fixture(scope="module")
def reference(engine):
    finals, failed = run(engine, {f"ref{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert not failed
    return {f"{i}": finals[f"ref{i}"].outputs[0].token_ids for i in range(len(PROMPTS))}


def good_requests(tag: str) -> dict[str, tuple[str, SamplingParams]]:
    return {f"{tag}{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}


def assert_innocents_unchanged(finals, reference, tag: str):
    for i in range(len(PROMPTS)):
        out = finals[f"{tag}{i}"]
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == reference[f"{i}"], i


@pytest.mark.parametrize("position", [0, 3, 7])
def test_injected_fault_fails_only_the_culprit(engine, reference, position):
    requests = list(good_requests(f"p{position}-").items())
    requests.insert(position, (f"bad{position}", (f"Hello {FAULT_MARKER} world", GREEDY)))
    finals, failed = run(engine, dict(requests))
    assert list(failed) == [f"bad{position}"]
    assert "InjectedFault: injected test fault" in failed[f"bad{position}"]
    assert finals[f"bad{position}"].outputs[0].finish_reason == "abort"
    assert_innocents_unchanged(finals, reference, f"p{position}-")
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks


def test_two_culprits_in_one_batch_both_fail_alone(engine, reference):
    requests = good_requests("two-")
    requests["badA"] = (f"{FAULT_MARKER} a", GREEDY)
    requests["badB"] = (f"b {FAULT_MARKER}", SamplingParams(temperature=0, max_tokens=6, n=2))
    finals, failed = run(engine, requests)
    assert sorted(failed) == ["badA", "badB"]
    assert_innocents_unchanged(finals, reference, "two-")


def test_a_value_that_slipped_past_validation_crashes_the_sampler_and_fails_alone(
    engine, reference
):
    poison = SamplingParams(temperature=0.7, max_tokens=4, logprobs=1)
    poison.logprobs = 10**6  # bypasses __post_init__, as a future bug might: topk(k > vocab)
    requests = good_requests("smp-")
    requests["poison"] = ("Tell me a story", poison)
    finals, failed = run(engine, requests)
    assert list(failed) == ["poison"]
    assert "out of range" in failed["poison"]
    assert_innocents_unchanged(finals, reference, "smp-")


def test_aborting_a_held_request_during_a_round_is_safe(engine, reference):
    requests = good_requests("ab-")
    requests["bad"] = (FAULT_MARKER, GREEDY)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while not engine.isolation.active:
        engine.step()
    engine.abort_request("ab-6")
    finals, failed = run(engine, {})
    assert list(failed) == ["bad"]
    assert "ab-6" not in finals
    for i in range(6):
        assert finals[f"ab-{i}"].outputs[0].token_ids == reference[f"{i}"]


def test_the_fault_hook_is_off_without_the_environment_variable(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    engine = LLMEngine(model=tiny_llama_dir, dtype="float32", kv_cache_memory="8MiB")
    finals, failed = run(engine, {"m": (FAULT_MARKER, GREEDY)})
    assert not failed and finals["m"].outputs[0].finish_reason == "length"


def test_without_isolation_the_step_raises(engine):
    engine.isolate_failures = False
    try:
        engine.add_request("raw", FAULT_MARKER, GREEDY)
        with pytest.raises(RuntimeError, match="injected test fault"):
            engine.step()
        engine.abort_request("raw")
    finally:
        engine.isolate_failures = True

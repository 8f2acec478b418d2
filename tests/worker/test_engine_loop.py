"""The engine thread and its tokenizer thread: prompts tokenized off the caller's thread, a
request that makes a step raise fails alone (RequestFailed), the others finish unchanged."""

from __future__ import annotations

import queue
import time

import pytest

from engine.llm_engine import FAULT_ENV, FAULT_MARKER, LLMEngine
from engine.sampling_params import SamplingParams
from worker.engine_loop import AddFailed, AddRequest, EngineLoop, RequestFailed, StepOutputs

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "1")
        return LLMEngine(model=tiny_llama_dir, dtype="float32", kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def expected(engine):
    """Greedy tokens of each prompt, from the engine stepped directly (no loop running)."""
    return reference(engine)


@pytest.fixture
def loop(engine, expected):
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()
    assert not engine.has_unfinished_requests()


def collect(loop: EngineLoop, ids: set[str], timeout: float = 120.0):
    """Finished outputs and failures (by id) until every id in `ids` ended."""
    finals, failures, steps = {}, {}, []
    deadline = time.monotonic() + timeout
    while ids - finals.keys() - failures.keys():
        event = loop.events.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(event, StepOutputs):
            steps.append(event)
            finals.update({o.request_id: o for o in event.outputs if o.finished})
        elif isinstance(event, AddFailed | RequestFailed):
            failures[event.request_id] = event
    return finals, failures, steps


def reference(engine: LLMEngine) -> dict[str, list[int]]:
    out = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ref{i}", prompt, GREEDY)
    engine.add_request("refchat", CHAT, GREEDY)
    while engine.has_unfinished_requests():
        out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    engine.kv_cache_manager.block_pool.reset_prefix_cache()
    return out


def test_text_ids_and_chat_are_tokenized_by_the_loop_and_match_the_engine(engine, expected, loop):
    loop.add(AddRequest("t0", PROMPTS[0], GREEDY))
    loop.add(AddRequest("t1", engine.tokenizer.encode(PROMPTS[1]), GREEDY, 0))
    loop.add(AddRequest("chat", CHAT, GREEDY))
    finals, failures, _ = collect(loop, {"t0", "t1", "chat"})
    assert not failures
    assert finals["t0"].outputs[0].token_ids == expected["ref0"]
    assert finals["t0"].prompt == PROMPTS[0]
    assert finals["t1"].outputs[0].token_ids == expected["ref1"]
    assert finals["chat"].outputs[0].token_ids == expected["refchat"]


def test_a_step_raising_request_fails_alone_with_request_failed(expected, loop):
    for i, prompt in enumerate(PROMPTS[:2]):
        loop.add(AddRequest(f"g{i}", prompt, GREEDY))
    loop.add(AddRequest("bad", f"x {FAULT_MARKER} y", GREEDY))
    for i, prompt in enumerate(PROMPTS[2:], start=2):
        loop.add(AddRequest(f"g{i}", prompt, GREEDY))
    ids = {f"g{i}" for i in range(len(PROMPTS))} | {"bad"}
    finals, failures, steps = collect(loop, ids)
    assert isinstance(failures["bad"], RequestFailed)
    assert "InjectedFault" in failures["bad"].error
    assert "bad" not in finals  # its "abort" output is not passed on as a finish
    assert all(o.request_id != "bad" or not o.finished for s in steps for o in s.outputs)
    for i in range(len(PROMPTS)):
        assert finals[f"g{i}"].outputs[0].token_ids == expected[f"ref{i}"]


def test_a_huge_prompt_is_tokenized_off_the_callers_thread_while_others_step(loop):
    loop.add(AddRequest("runner", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)))
    huge = "hello world, this is a long prompt. " * 30_000  # ~1 MB of text
    loop.add(AddRequest("huge", huge, GREEDY))
    # add() returned at once: the prompt is still with the tokenizer thread.
    assert loop.num_pending_adds >= 1
    finals, failures, steps = collect(loop, {"huge", "runner"})
    assert "must be shorter than max_model_len" in failures["huge"].error
    runner_steps = [s for s in steps if any(o.request_id == "runner" for o in s.outputs)]
    assert len(runner_steps) == 200


def test_abort_while_tokenizing_never_reaches_the_engine(engine, loop):
    huge = "many words here. " * 40_000
    loop.add(AddRequest("slow", huge, GREEDY))
    loop.add(AddRequest("gone", PROMPTS[0], GREEDY))
    loop.abort("gone")
    loop.add(AddRequest("kept", PROMPTS[1], GREEDY))
    finals, failures, _ = collect(loop, {"slow", "kept"})
    assert "kept" in finals and "slow" in failures
    with pytest.raises(queue.Empty):
        while True:
            event = loop.events.get(timeout=0.5)
            assert all(o.request_id != "gone" for o in getattr(event, "outputs", []))
    assert "gone" not in engine.parents

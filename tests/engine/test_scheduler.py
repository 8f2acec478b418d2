"""Scheduler behaviour on a real (tiny) model: budgets, continuous batching, preemption."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.request import RequestStatus


def make_engine(folder, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 2**22)
    return LLMEngine(model=folder, dtype="float32", **kw)


def check_invariants(engine: LLMEngine) -> None:
    kv = engine.kv_cache_manager
    held = sum(
        sum(1 for b in group if b is not kv.null_block)
        for blocks in kv.req_to_blocks.values()
        for group in blocks
    ) + (kv.null_block is not None)
    assert sum(b.ref_cnt for b in kv.block_pool.blocks) == held
    assert kv.num_free_blocks == sum(1 for b in kv.block_pool.blocks if b.ref_cnt == 0)
    out = engine.scheduler.last_output
    if out is not None:
        assert out.total_num_scheduled_tokens <= engine.config.max_num_batched_tokens
        assert len(out.scheduled) <= engine.config.max_num_seqs
        assert sum(s.num_new_tokens for s in out.scheduled) == out.total_num_scheduled_tokens


def run_all(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check_invariants(engine)
    return finished


def test_budgets_and_max_num_seqs_hold_every_step(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(8):
        engine.add_request(
            str(i),
            list(range(10, 10 + 7 * (i + 1))),
            SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True),
        )
    finished = run_all(engine)
    assert sorted(finished) == [str(i) for i in range(8)]
    assert [len(finished[str(i)].outputs[0].token_ids) for i in range(8)] == [
        3 + i for i in range(8)
    ]
    # All blocks back, none held.
    assert engine.kv_cache_manager.num_free_blocks == engine.get_stats().num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv_cache_manager.block_pool.blocks)


PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block_size * kv_heads * head_dim * 4 B


def test_continuous_batching_step_trace(tiny_llama_dir):
    # Four blocks: "short" and "long" hold them all, so "late" can only use what "short" frees.
    engine = make_engine(tiny_llama_dir, max_num_seqs=2, kv_cache_memory=4 * PER_BLOCK)
    engine.add_request(
        "short", [5] * 16, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    )
    engine.add_request(
        "long", [6] * 16, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    engine.add_request(
        "late", [7] * 16, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    )
    trace = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        sched = engine.scheduler.last_output
        trace.append(
            {
                "scheduled": {
                    s.request.request_id: (s.num_new_tokens, tuple(s.block_ids[0]))
                    for s in sched.scheduled
                },
                "finished": [o.request_id for o in outs if o.finished],
            }
        )
    # Step 0: both prefills; "late" waits (max_num_seqs=2).
    assert set(trace[0]["scheduled"]) == {"short", "long"}
    finish_step = next(i for i, t in enumerate(trace) if "short" in t["finished"])
    short_blocks = set(trace[finish_step]["scheduled"]["short"][1])
    nxt = trace[finish_step + 1]["scheduled"]
    # The next step admits "late" while "long" is mid-decode (one new token)...
    assert nxt["long"][0] == 1 and nxt["late"][0] == 16
    # ...into the blocks "short" just freed.
    assert short_blocks & set(nxt["late"][1])


def test_preemption_latest_arrival_first_and_readmitted_ahead(tiny_llama_dir):
    # 4 blocks of 16 tokens cannot hold three requests that each grow past one block.
    engine = make_engine(tiny_llama_dir, kv_cache_memory=4 * PER_BLOCK)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("old", [5] * 16, params, arrival_time=1.0)
    engine.add_request("new", [6] * 16, params, arrival_time=2.0)
    engine.add_request("newest", [7] * 4, params, arrival_time=3.0)
    order, preempted = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
        step_preempted = engine.scheduler.last_output.preempted_ids
        if step_preempted and not preempted:
            engine.add_request("later", [8] * 4, params, arrival_time=4.0)
        preempted += step_preempted
        check_invariants(engine)
    assert preempted[0] == "newest"
    assert "old" not in preempted
    # The victim is re-admitted ahead of "later", which arrived after it.
    assert order.index("newest") < order.index("later")
    assert order[0] == "old"


def test_abort_frees_blocks_at_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", [5] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.get_stats().num_blocks
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.get_stats().num_blocks


def test_priority_policy_runs_urgent_first(tiny_llama_dir):
    engine = make_engine(
        tiny_llama_dir, max_num_seqs=1, scheduling_policy="priority", priority_aging_seconds=None
    )
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", [5] * 4, p, priority=5, arrival_time=1.0)
    engine.add_request("high", [6] * 4, p, priority=-1, arrival_time=2.0)
    order = [o.request_id for o in run_all(engine).values()]
    assert order == ["high", "low"]


def test_finished_status_and_reasons(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("x", [5] * 4, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    req = engine.scheduler.requests["x"]
    out = run_all(engine)["x"]
    assert out.outputs[0].finish_reason == "length"
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_shared_system_prompt_is_computed_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    system = list(range(200, 264))  # 4 full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(8):
        engine.add_request(str(i), system + [300 + i, 301 + i], params)
    run_all(engine)
    kv = engine.kv_cache_manager
    # Seven of the eight requests hit all four blocks of the shared prefix.
    assert kv.prefix_cache_hits == 7 * 64
    assert engine.get_stats().num_prompt_tokens == 8 * 66 - 7 * 64


def test_tenants_are_counted_and_bad_fields_named(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, scheduling_policy="fair", tenant_weights={"a": 2.0})
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("1", [5] * 4, p, tenant="a")
    engine.add_request("2", [6] * 4, p, tenant="b")
    engine.add_request("3", [7] * 4, p)
    with pytest.raises(ValueError, match="tenant=7 is invalid"):
        engine.add_request("x", [5] * 4, p, tenant=7)
    with pytest.raises(ValueError, match="priority='high' is invalid"):
        engine.add_request("x", [5] * 4, p, priority="high")
    run_all(engine)
    stats = engine.get_stats()
    assert stats.tenant_generated_tokens == {"a": 3, "b": 3, "default": 3}
    assert stats.num_scheduled_requests == 3 and stats.mean_queue_time_s >= 0
    assert stats.generation_tokens_per_s > 0

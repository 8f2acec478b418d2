"""The scheduler without a model: exact admission orders, victims, swap out and back in.

A fake step stands in for the model: it marks scheduled tokens computed and "samples" token 7.
"""

from __future__ import annotations

import torch

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.swap import PreemptionCostModel, SwapSpace

BLOCK = 4


def req(rid, arrival, tenant=None, priority=0, prompt=4, max_tokens=4) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        rid, [9] * prompt, params, priority=priority, arrival_time=arrival, tenant=tenant
    )


def make(num_blocks=64, swap_blocks=0, clock=lambda: 0.0, **cfg):
    kv = KVCacheManager(num_blocks, BLOCK)
    swap = cost = None
    if swap_blocks:
        caches = [torch.zeros(2, num_blocks, BLOCK, 1, 2) for _ in range(2)]
        swap = SwapSpace(caches, swap_blocks)
        # Copying is free next to recomputing: every victim with KV is swapped.
        cost = PreemptionCostModel(copy_bytes_per_s=1e12, prefill_tokens_per_s=1.0)
    cfg.setdefault("aging_seconds", None)
    sched = Scheduler(SchedulerConfig(**cfg), kv, swap, cost, clock=clock)
    return sched, kv, swap


def fake_step(sched: Scheduler) -> tuple[list[str], list[str]]:
    """One step; returns (ids scheduled, ids finished)."""
    out = sched.schedule()
    sampled = {}
    for row, s in enumerate(out.scheduled):
        r = s.request
        r.num_computed_tokens += s.num_new_tokens
        if r.num_computed_tokens == r.num_tokens:
            sampled[row] = None
    sched.update_after_step(out, sampled, 0.01)
    finished = []
    for row in sampled:
        r = out.scheduled[row].request
        r.append_output_token(7)
        if r.num_output_tokens >= r.params.max_tokens:
            sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
            finished.append(r.request_id)
    return [s.request.request_id for s in out.scheduled], finished


def check_hashes(kv: KVCacheManager) -> None:
    """The prefix-cache map only points at blocks that carry that very hash."""
    for block_hash, block in kv.block_pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


def run(sched: Scheduler) -> list[str]:
    order = []
    while sched.has_unfinished_requests():
        order += fake_step(sched)[1]
    return order


def test_fair_policy_interleaves_tenants_1_to_1():
    sched, kv, _ = make(max_num_seqs=1, policy="fair")
    for i in range(6):
        sched.add_request(req(f"a{i}", i, tenant="A"))
    for i in range(2):
        sched.add_request(req(f"b{i}", 10 + i, tenant="B"))
    # Each request costs 4 prompt + 3 decode tokens; the tenant behind goes next, ties by arrival.
    assert run(sched) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
    assert sched.fair.generated_tokens == {"A": 24, "B": 8}
    assert kv.num_free_blocks == 64


def test_fair_policy_weights_2_to_1():
    sched, _, _ = make(max_num_seqs=1, policy="fair", tenant_weights={"A": 2.0})
    for i in range(6):
        sched.add_request(req(f"a{i}", i, tenant="A"))
    for i in range(2):
        sched.add_request(req(f"b{i}", 10 + i, tenant="B"))
    assert run(sched) == ["a0", "a1", "b0", "a2", "a3", "b1", "a4", "a5"]


def test_fcfs_policy_ignores_tenants_and_priority():
    sched, _, _ = make(max_num_seqs=1, policy="fcfs")
    sched.add_request(req("a", 0, tenant="A", priority=5))
    sched.add_request(req("b", 1, tenant="B", priority=0))
    sched.add_request(req("c", 2, tenant="A"))
    assert run(sched) == ["a", "b", "c"]


def test_new_tenant_gets_no_credit_for_idle_time():
    sched, _, _ = make(max_num_seqs=1, policy="fair")
    for i in range(3):
        sched.add_request(req(f"a{i}", i, tenant="A"))
    fake_step(sched)  # a0 prefill
    for _ in range(3):
        fake_step(sched)
    # A has been served 7 tokens alone; B arrives now and starts at A's virtual time.
    sched.add_request(req("b0", 5, tenant="B"))
    assert sched.fair.virtual_time["B"] == sched.fair.virtual_time["A"] == 7.0
    assert run(sched) == ["a1", "b0", "a2"]


def test_fair_victim_is_the_tenant_ahead_of_its_share():
    # Two blocks: two 4-token prompts fit, their first decode needs a block each.
    sched, kv, _ = make(num_blocks=2, policy="fair")
    sched.add_request(req("a", 0, tenant="A"))
    sched.add_request(req("b", 1, tenant="B"))
    sched.fair.charge(req("x", 0, tenant="A"), 100)
    fake_step(sched)
    scheduled, _ = fake_step(sched)
    # "a" arrived first but its tenant is 100 tokens ahead: it is the victim (recompute).
    assert scheduled == ["b"]
    a = sched.requests["a"]
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert sched.num_preemptions_by_kind == {"recompute": 1, "swap": 0}


def test_fcfs_victim_is_the_latest_arrival():
    sched, _, _ = make(num_blocks=2, policy="fcfs")
    sched.add_request(req("a", 0, tenant="A"))
    sched.add_request(req("b", 1, tenant="B"))
    sched.fair.charge(req("x", 0, tenant="A"), 100)
    fake_step(sched)
    assert fake_step(sched)[0] == ["a"]


def test_swap_keeps_progress_frees_blocks_and_comes_back_before_new_work():
    sched, kv, swap = make(num_blocks=4, swap_blocks=8, policy="fcfs")
    caches = swap.kv_caches
    sched.add_request(req("a", 0, prompt=8, max_tokens=8))
    sched.add_request(req("b", 1, prompt=8, max_tokens=8))
    fake_step(sched)  # both prefilled: 2 blocks each, pool full
    b = sched.requests["b"]
    b_blocks = kv.get_block_ids("b")[0]
    for layer in caches:  # give b's KV recognisable content
        layer[:, b_blocks] = torch.arange(1.0, 1 + len(b_blocks)).view(1, -1, 1, 1, 1)
    scheduled, _ = fake_step(sched)  # a needs a third block: b is swapped out
    assert scheduled == ["a"]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 8
    assert sched.num_preemptions_by_kind == {"recompute": 0, "swap": 1}
    assert sched.swapped_out_bytes == 2 * swap.bytes_per_block
    assert swap.num_free_blocks == 6 and sched.num_swapped == 1
    assert "b" not in kv.req_to_blocks
    held = sum(len(group) for v in kv.req_to_blocks.values() for group in v)
    assert sum(blk.ref_cnt for blk in kv.block_pool.blocks) == held == 3
    for layer in caches:  # the device copy is gone: only the host copy can bring it back
        layer[:, b_blocks] = 0.0
    sched.add_request(req("c", 2, prompt=4, max_tokens=2))
    order, content = [], None
    while sched.has_unfinished_requests():
        scheduled, finished = fake_step(sched)
        if content is None and "b" in scheduled:
            content = [layer[:, kv.get_block_ids("b")[0][:2], 0, 0, 0].tolist() for layer in caches]
            # Its full blocks are published again under the same chained hashes.
            pool = kv.block_pool.cached_block_hash_to_block
            assert all((0, h) in pool for h in b.block_hashes[:2])  # group 0's keys
        check_hashes(kv)
        order += finished
    # b comes back (content copied into its new blocks) before c is admitted.
    assert order == ["a", "b", "c"]
    assert content == [[[1.0, 2.0], [1.0, 2.0]]] * 2
    assert kv.num_free_blocks == 4 and swap.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)


def test_swap_falls_back_to_recompute_when_the_pool_is_full():
    sched, kv, swap = make(num_blocks=4, swap_blocks=1, policy="fcfs")
    sched.add_request(req("a", 0, prompt=8, max_tokens=8))
    sched.add_request(req("b", 1, prompt=8, max_tokens=8))
    fake_step(sched)
    assert sched.preemption_kind(sched.requests["b"]) == "recompute"  # needs 2 host blocks
    fake_step(sched)
    assert sched.num_preemptions_by_kind == {"recompute": 1, "swap": 0}
    assert run(sched) == ["a", "b"]


def test_abort_of_a_swapped_request_frees_its_host_blocks():
    sched, kv, swap = make(num_blocks=4, swap_blocks=8, policy="fcfs")
    sched.add_request(req("a", 0, prompt=8, max_tokens=8))
    sched.add_request(req("b", 1, prompt=8, max_tokens=8))
    fake_step(sched)
    fake_step(sched)
    assert sched.requests["b"].status is RequestStatus.SWAPPED
    sched.abort_request("b")
    assert swap.num_free_blocks == 8 and sched.num_swapped == 0 and sched.num_waiting == 0
    assert run(sched) == ["a"]


def test_queue_time_and_generation_rate_use_the_clock():
    now = [100.0]
    sched, _, _ = make(max_num_seqs=1, policy="fcfs", clock=lambda: now[0])
    sched.add_request(req("a", 90.0, max_tokens=2))
    sched.add_request(req("b", 96.0, max_tokens=2))
    while sched.has_unfinished_requests():
        fake_step(sched)
        now[0] += 1.0
    # a: 100 - 90; b admitted at 102 (steps at 100, 101): 102 - 96.
    assert sched.mean_queue_time == (10.0 + 6.0) / 2
    assert sched.generation_rate.rate(now[0]) == 4 / 4.0

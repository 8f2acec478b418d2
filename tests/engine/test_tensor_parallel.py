"""Tensor parallel at two ranks (gloo, one thread each): greedy tokens equal those at one rank
(Hugging Face's) for a dense, an MoE (both MoE splits), a sinks-and-windows, a latent-attention,
a hybrid linear-attention and a short-convolution (LFM2) model; prefix caching, preemption by
swap, n > 1 seeded samples and a JSON schema give what one rank gives; each rank holds about
half the weights; a rank that dies or hangs stops the engine with ``RankFailure`` instead of a
hang.

Every two-rank engine here is made after the one-rank engines it is compared with: a process
has one tensor-parallel group at a time, and its layers read it."""

from __future__ import annotations

import json
import os
import signal
import time

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_loader import load_model
from engine.parallel.ranks import RankFailure
from engine.structured_outputs import StructuredOutputsParams
from tests.engine.test_architectures import PROMPTS, SCHEMA, built, one_thread  # noqa: F401

pytestmark = pytest.mark.slow

FAMILIES = [
    "llama", "qwen3-moe", "gpt-oss", "deepseek-v3", "qwen3.5", "lfm3", "falcon-h1", "olmo-hybrid",
    "nemotron-h", "jamba", "minimax", "llama4", "deepseek-v32",
    "mimo-v2-flash", "longcat-flash", "axk2", "falcon-40b", "bloom",
]  # fmt: skip


def two_ranks(folder, **kwargs) -> LLM:
    """An fp32 engine over two ranks with a small KV pool."""
    kwargs.setdefault("kv_cache_memory", 2**22)
    return LLM(str(folder), dtype="float32", block_size=16, tensor_parallel_size=2, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("case_id", FAMILIES)
def test_two_ranks_give_hugging_face_greedy_tokens(case_id, tmp_path_factory):
    folder, expected = built(case_id, tmp_path_factory)  # HF's tokens = one rank's (tested)
    with two_ranks(folder) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_experts_split_per_expert_give_the_same_tokens(tmp_path_factory):
    folder, expected = built("qwen3-moe", tmp_path_factory)
    with two_ranks(folder, moe_parallel="tp") as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def _features(llm: LLM, prompts, shared):
    """Prefix-cache hits, preemption (by swap) in a small pool, seeded n > 1 samples and a
    JSON schema, run by ``llm``; returns what each gave and the engine's counters."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    greedy = token_ids(llm.generate(prompts, params, use_tqdm=False))
    again = token_ids(llm.generate([shared + [7, 8]], params, use_tqdm=False))
    seeded = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    samples = [c.token_ids for c in llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs]
    json_params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    structured = llm.generate([PROMPTS[0]], json_params, use_tqdm=False)[0].outputs[0]
    return (greedy, again, samples, structured.text), llm.stats


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The Qwen3.5 hybrid (state slots, snapshots and their copies beside paged KV)."""
    return built("qwen3.5", tmp_path_factory)[0]


def test_prefix_cache_swap_samples_and_json_match_one_rank(hybrid):
    shared = list(range(100, 164))  # four full blocks, the state snapshot after them
    prompts = [shared + [i] * 9 for i in range(1, 7)]
    # Ten blocks (the state slots take the rest): the requests wait or are swapped out.
    with LLM(str(hybrid), dtype="float32", block_size=16, num_threads=1) as probe:
        per_block = probe.llm_engine._kv_bytes_per_block()
    small = dict(kv_cache_memory=24 * per_block, swap_space=0.01, max_num_seqs=4)
    with LLM(str(hybrid), dtype="float32", block_size=16, num_threads=1, **small) as one:
        want, one_stats = _features(one, prompts, shared)
    # Each rank keeps half of every block: the same pool holds the same number of blocks.
    small["kv_cache_memory"] = small["kv_cache_memory"] // 2
    with two_ranks(hybrid, **small) as llm:
        got, stats = _features(llm, prompts, shared)
    assert stats.num_blocks == one_stats.num_blocks
    assert got == want
    assert stats.num_preemptions_swap > 0 and stats.prefix_cache_hits > 0
    jsonschema.validate(json.loads(got[3]), SCHEMA)


def test_each_rank_holds_about_half_the_weights(tmp_path_factory):
    folder, _ = built("qwen3-moe", tmp_path_factory)
    # A fresh load (the cached one may be packed for the CPU since).
    model = load_model.__wrapped__(str(folder), torch.float32, torch.device("cpu"), "auto")[0]
    whole = model.weight_bytes()
    with two_ranks(folder) as llm:
        rank0 = llm.llm_engine.model.weight_bytes()
    # Norms, routers and the replicated KV head are whole on each rank: a little over half.
    assert 0.5 * whole <= rank0 <= 0.56 * whole, (rank0, whole)


def test_a_rank_that_dies_stops_the_engine(tmp_path_factory):
    folder, _ = built("llama", tmp_path_factory)
    with two_ranks(folder) as llm:
        rank1 = llm.llm_engine.ranks.processes[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1 exited"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5


def test_a_rank_that_hangs_stops_the_engine_at_the_collective_timeout(
    tmp_path_factory, monkeypatch
):
    monkeypatch.setenv("PAGEDQ_COLLECTIVE_TIMEOUT_S", "3")
    folder, _ = built("llama", tmp_path_factory)
    with two_ranks(folder) as llm:
        rank1 = llm.llm_engine.ranks.processes[0]
        os.kill(rank1.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            # The step's collective times out, or the keepalive finds no answer first.
            with pytest.raises(RankFailure, match="tensor-parallel"):
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        finally:
            os.kill(rank1.pid, signal.SIGKILL)
        assert time.monotonic() - start < 30


def test_more_ranks_than_cpus_is_refused_naming_both():
    cpus = len(os.sched_getaffinity(0))
    refusal = f"tensor_parallel_size={cpus + 1} is more than the {cpus}"
    with pytest.raises(ValueError, match=refusal):
        LLM("smollm2", tensor_parallel_size=cpus + 1)

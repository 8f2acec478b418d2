"""The Transformers backend at two ranks (gloo, one thread each), split by each config's own
tensor-parallel plan: greedy tokens equal one rank's (Hugging Face's) for a family with sliding
windows (Cohere 2), one with every multiplier of its own and a tied LM head (Granite), one with
biases and a window on every layer (Starcoder 2) and fused experts (OLMoE), whose ranks' shares
add up to the whole split either way; each rank holds about half the weights; a family with no
plan, or with a per-head weight the plan leaves whole, is refused naming it.

Every two-rank engine here is made after the one-rank engines it is compared with: a process
has one tensor-parallel group at a time, and its layers read it."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import TINY, make_tiny_model, tiny_hf_model

from engine.model_loader import load_model
from tests.engine.test_architectures import PROMPTS, case_builder, one_thread  # noqa: F401
from tests.engine.test_tensor_parallel import GREEDY, token_ids, two_ranks
from tests.engine.test_transformers_backend import CASE_BY_ID

pytestmark = pytest.mark.slow

CASES = {
    **{k: CASE_BY_ID[k] for k in ("cohere2", "starcoder2", "olmoe")},
    "granite-tied": ("granite", {**CASE_BY_ID["granite"][1], "tie_word_embeddings": True}),
}
built = case_builder(CASES)


@pytest.mark.parametrize("case_id", ["cohere2", "granite-tied"])
def test_two_ranks_give_hugging_face_greedy_tokens(case_id, tmp_path_factory):
    folder, expected = built(case_id, tmp_path_factory)  # HF's = one rank's (tested there)
    with two_ranks(folder) as llm:
        assert type(llm.llm_engine.model).__name__ == "TransformersForCausalLM"
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_biases_split_and_each_rank_holds_about_half_the_weights(tmp_path_factory):
    folder, expected = built("starcoder2", tmp_path_factory)
    # A fresh load (the cached one may be packed for the CPU since).
    model = load_model.__wrapped__(str(folder), torch.float32, torch.device("cpu"), "auto")[0]
    whole = model.weight_bytes()
    with two_ranks(folder) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        rank0 = llm.llm_engine.model.weight_bytes()
    # Norms and the row-parallel layers' biases are whole on each rank: a little over half.
    assert 0.5 * whole <= rank0 <= 0.52 * whole, (rank0, whole)


def test_fused_experts_split_over_two_ranks_give_the_same_tokens(tmp_path_factory):
    folder, expected = built("olmoe", tmp_path_factory)  # experts spread whole ("ep")
    with two_ranks(folder) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("moe_parallel", ["ep", "tp"])
def test_the_ranks_shares_of_the_experts_sum_to_the_whole(moe_parallel, monkeypatch):
    """Each rank's share (whole experts, or every expert's features), loaded from the whole
    fused tensors, adds up to all the experts' weighted sum (one process playing both ranks)."""
    import torch.distributed as dist

    from engine.models.linear import load_param
    from engine.models.transformers import experts
    from kernels.reference import fused_experts_torch

    hf = tiny_hf_model("olmoe", vocab_size=256, num_experts=8, num_experts_per_tok=3)
    whole = hf.model.layers[0].mlp.experts
    assert experts.fused_layout(whole)
    torch.manual_seed(0)
    x, weights = torch.randn(7, TINY["hidden_size"]), torch.rand(7, 3)
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(7)])
    want = fused_experts_torch(x, whole.gate_up_proj, whole.down_proj, weights, ids)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    got = torch.zeros_like(want)
    for rank in (0, 1):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        share = copy.deepcopy(whole)
        experts.split(share, moe_parallel)
        for name in ("gate_up_proj", "down_proj"):
            load_param(getattr(share, name), getattr(whole, name).detach(), None, name)
        assert share.gate_up_proj.numel() == whole.gate_up_proj.numel() // 2
        got += experts._rank_share(share, x, ids, weights)
    torch.testing.assert_close(got, want)


def test_a_family_without_a_plan_is_refused_before_any_rank_starts(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("stablelm"), "stablelm")
    match = r"model_impl='auto' serves model_type='stablelm' on the Transformers backend, which "
    match += r"cannot split it over tensor_parallel_size=2: config\.base_model_tp_plan is empty"
    with pytest.raises(ValueError, match=match):
        two_ranks(folder)


def test_a_per_head_weight_the_plan_leaves_whole_is_refused_naming_it(monkeypatch):
    """Cohere's q/k norms hold ``[heads, head_dim]`` weights its plan does not split: refused
    as a rank builds the model (here one process that sees a group of two)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from engine.models.transformers.model import TransformersForCausalLM

    config = AutoConfig.for_model("cohere", vocab_size=256, use_qk_norm=True, **TINY)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    match = r"tensor_parallel_size=2: layers\.0\.self_attn\.q_norm\.weight \(4, 16\) holds "
    match += r"per-head weights that config\.base_model_tp_plan does not split"
    with pytest.raises(ValueError, match=match):
        TransformersForCausalLM(config, max_position=512)

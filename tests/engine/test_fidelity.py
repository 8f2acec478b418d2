"""bf16 is as faithful to fp32 as Hugging Face's bf16: on tiny random models of several families
(dense, MoE, hybrid linear attention, a Mamba-2 hybrid), pagedq's bf16 next-token distributions
are no further from HF fp32's than HF bf16's are (mean KL, teacher forced), and its fp32 ones
are HF's."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from bench.fidelity import hf_logits, hf_model, mean_kl, pagedq_llm, pagedq_logits

# Prompts and their "answers" (teacher-forced continuations): random ids, several lengths.
GEN = torch.Generator().manual_seed(7)
SEQUENCES = [
    (
        torch.randint(3, 4000, (n,), generator=GEN).tolist(),
        torch.randint(3, 4000, (m,), generator=GEN).tolist(),
    )
    for n, m in ((5, 48), (23, 40), (40, 64), (90, 32))
]
PROMPTS = [p for p, _ in SEQUENCES]
ANSWERS = [a for _, a in SEQUENCES]
# pagedq's bf16 may sum in another order than HF's; "a small factor" of HF's own loss.
FACTOR = 1.25
SEEDS = (0, 1, 2, 3)

CASES = [
    ("llama", "llama", {}),
    (
        "qwen3-moe",
        "qwen3_moe",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48, "head_dim": 16},
    ),
    (
        "qwen3.5-hybrid",
        "qwen3_5_text",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    ),  # fmt: skip
    (
        "falcon-h1",  # Mamba-2 beside attention in every layer
        "falcon_h1",
        {
            "num_hidden_layers": 2,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_ssm": 128,
            "mamba_n_groups": 2,
            "mamba_d_state": 8,
            "mamba_chunk_size": 16,
        },
    ),  # fmt: skip
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def kl(reference, logits) -> float:
    return sum(mean_kl(r, x) for r, x in zip(reference, logits)) / len(logits)


@pytest.mark.parametrize(("case_id", "model_type", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_bf16_is_no_further_from_fp32_than_hf_bf16(tmp_path, case_id, model_type, overrides):
    # Four random models per family: one expert flipped by a near tie (MoE), or one chaotic
    # position, weighs as much as the rest of one model's positions (per-model ratios 0.2-1.7x).
    hf_bf16 = ours = 0.0
    for seed in SEEDS:
        folder = str(make_tiny_model(tmp_path / f"{case_id}-{seed}", model_type, seed, **overrides))
        reference = hf_logits(hf_model(folder, torch.float32), PROMPTS, ANSWERS)
        hf_bf16 += kl(reference, hf_logits(hf_model(folder, torch.bfloat16), PROMPTS, ANSWERS))
        fp32 = pagedq_logits(pagedq_llm(folder, "float32", num_threads=1), PROMPTS, ANSWERS)
        assert abs(kl(reference, fp32)) < 1e-6  # the same model: only summation order differs
        bf16 = pagedq_logits(pagedq_llm(folder, "bfloat16", num_threads=1), PROMPTS, ANSWERS)
        ours += kl(reference, bf16)
    assert 0 < hf_bf16 and 0 < ours <= FACTOR * hf_bf16, (case_id, ours, hf_bf16)

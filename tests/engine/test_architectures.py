"""Each supported architecture, as a tiny random checkpoint made at test time from transformers'
own config class, gives Hugging Face's greedy tokens.

A family adds its rows to ``CASES``: (id, model_type, config overrides). Prompts are longer than
the sliding windows a case sets, and MoE cases route several experts per token."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from engine import LLM, SamplingParams

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [5, 77, 901, 12, 12, 3000, 45, 8, 9, 10, 11] * 3, [42]]


def hf_tokens(folder, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


CASES = [
    ("llama", "llama", {}),
    (
        "llama3-rope",
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("qwen2-bias", "qwen2", {}),
    ("qwen3-qknorm", "qwen3", {}),
    ("mistral-tied", "mistral", {"tie_word_embeddings": True}),
    # Mixtures of experts: several experts per token, per-expert and fused 3-D checkpoints.
    (
        "qwen3-moe",
        "qwen3_moe",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
         "head_dim": 16, "mlp_only_layers": [1], "norm_topk_prob": True},
    ),
    (
        "qwen3-moe-fused",
        "qwen3_moe",
        {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
         "head_dim": 16, "norm_topk_prob": False, "save_original_format": False},
    ),
    (
        "qwen2-moe-shared",
        "qwen2_moe",
        {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
    ),
    (
        "mixtral-window",
        "mixtral",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 96,
         "sliding_window": 8},
    ),
    (
        "gpt-oss",
        "gpt_oss",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 64,
         "head_dim": 16, "sliding_window": 8, "num_hidden_layers": 3},
    ),
    (
        "glm4-moe",
        "glm4_moe",
        {"n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
         "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
         "partial_rotary_factor": 0.5, "head_dim": 16, "attention_bias": True,
         "routed_scaling_factor": 2.0, "num_hidden_layers": 3},
    ),
]  # fmt: skip


@pytest.mark.parametrize("model_type,overrides", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_tiny_model_matches_hf(tmp_path, model_type, overrides):
    folder = make_tiny_model(tmp_path / model_type, model_type, **overrides)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=2**22, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [hf_tokens(folder, p, 20) for p in PROMPTS]


def test_unsupported_architecture_is_refused(tmp_path):
    import json

    folder = make_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError):
        LLM(str(folder), dtype="float32", kv_cache_memory=2**22)

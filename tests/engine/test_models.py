"""Each supported architecture, as tiny random checkpoints, gives Hugging Face's greedy tokens."""

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


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        (
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
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"tie_word_embeddings": True}),
    ],
    ids=["llama", "llama3-rope", "qwen2-bias", "qwen3-qknorm", "mistral-tied"],
)
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

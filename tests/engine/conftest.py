"""Engine test fixtures: the real default model, loaded once per session."""

from __future__ import annotations

import pytest
import torch

from engine.model_loader import resolve_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Name a mammal that can fly.",
    "What does a thermometer measure?",
    "Suggest a name for a pet goldfish.",
    "Why is the sky blue? Answer briefly.",
    "What is the boiling point of water in Celsius?",
    "Describe a cat in five words.",
    "What is the largest planet in our solar system?",
    "Tell me a fun fact about octopuses, and then explain in detail why it is surprising "
    "to most people who have never studied marine biology or watched documentaries.",
]


@pytest.fixture(scope="session")
def hf_smollm2():
    """Hugging Face's own model and tokenizer from the same GGUF file, fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        src.folder, gguf_file=src.gguf_file, dtype=torch.float32
    ).eval()
    return model, tok


@pytest.fixture(scope="session")
def chat_prompt_ids(hf_smollm2):
    """Token ids of CHAT_PROMPTS with the model's chat template."""
    from bench.fidelity import chat_ids

    return chat_ids(hf_smollm2[1], CHAT_PROMPTS)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=2) -> list[int]:
    """Hugging Face greedy generation for one prompt: the reference tokens (EOS included)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def hf_reference(hf_smollm2, chat_prompt_ids):
    """HF greedy tokens of every chat prompt, 24 new tokens at most."""
    model, _ = hf_smollm2
    return [hf_greedy(model, ids, MAX_TOKENS) for ids in chat_prompt_ids]


MAX_TOKENS = 24

"""Tiny random Llama-family checkpoints written at test time (safetensors + tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model_loader import load_tokenizer, resolve_model

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_model(folder: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """Save a random ``model_type`` model with the default model's tokenizer into ``folder``."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    kwargs = {**TINY, "vocab_size": len(tokenizer), **overrides}
    if model_type == "qwen3":
        kwargs.setdefault("head_dim", 16)
    config = cls[0](**kwargs)
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    # Larger weights than the default init spread the logits, so greedy argmax is robust
    # to the last-bit differences between two correct implementations.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder

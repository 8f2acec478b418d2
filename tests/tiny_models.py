"""Tiny random checkpoints of any architecture transformers knows, written at test time
(safetensors + the default model's tokenizer)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from engine.model_loader import cached_source, load_tokenizer, resolve_model

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


@lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer, read once per process (from the model cache's folder:
    parsing the GGUF file again takes seconds)."""
    return load_tokenizer(cached_source(resolve_model("smollm2")))


def causal_lm_class(model_type: str):
    """transformers' causal-LM class of ``model_type``: AutoModelForCausalLM's, the image-text
    one's for a multimodal wrapper (Mistral 3), or the family's own ``...ForCausalLM`` where the
    auto mappings leave it out (Mistral 4's text model)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    # A multimodal wrapper first: Llama 4's causal-LM mapping builds its text model alone.
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    config_class = type(transformers.AutoConfig.for_model(model_type))
    return getattr(transformers, config_class.__name__.replace("Config", "ForCausalLM"))


def tiny_hf_model(model_type: str, seed: int = 0, **overrides):
    """A random ``model_type`` model of transformers' own config class and model, built from
    ``TINY`` and ``overrides``, with weights spread wider than the default init."""
    from transformers import AutoConfig

    kwargs = {**TINY, **overrides}
    if model_type == "qwen3":
        kwargs.setdefault("head_dim", 16)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model_class = causal_lm_class(model_type)
    # The Auto class builds from a config; a family's own class is built by calling it.
    model = getattr(model_class, "from_config", model_class)(config).eval()
    # Larger weights than the default init spread the logits, so greedy argmax is robust
    # to the last-bit differences between two correct implementations.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "bias" not in name:  # 3-D: fused experts
                p.normal_(0, 0.15)
            elif "bias" in name:
                p.normal_(0, 0.1)
            elif "norm" in name:  # around its init: 1 (Llama) or 0 (Gemma's 1 + w)
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("correct_output_scale"):  # Gemma 3n's AltUp: 0 at init
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # zeros at init
                b.normal_(0, 0.1)
    return model


def make_tiny_model(
    folder: Path, model_type: str, seed: int = 0, save_original_format: bool = True, **overrides
) -> Path:
    """Save a random ``model_type`` model (transformers' own config class and model, built
    from ``TINY`` and ``overrides``) with the default model's tokenizer into ``folder``;
    ``save_original_format=False`` writes transformers 5's own layout (fused 3-D experts)."""
    tokenizer = default_tokenizer()
    kwargs = {"vocab_size": len(tokenizer), **overrides}
    if model_type == "gemma4_text":  # its per-layer table covers the whole vocabulary
        kwargs.setdefault("vocab_size_per_layer_input", kwargs["vocab_size"])
    model = tiny_hf_model(model_type, seed, **kwargs)
    model.save_pretrained(
        folder, safe_serialization=True, save_original_format=save_original_format
    )
    tokenizer.save_pretrained(folder)
    return folder

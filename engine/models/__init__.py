"""The model registry: one file per family, looked up by ``config.model_type``.

Shared layers (attention with its options, rotary embeddings, norms, MLPs, the decoder block,
the causal-LM shell) live beside the family files; a family file composes them and says only
what is new in it.
"""

from __future__ import annotations

import importlib

# model_type -> (module, class). Imported on first use, so a family's imports cost nothing
# to the others.
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "llama": ("engine.models.llama", "LlamaForCausalLM"),
    "mistral": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen2": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen3": ("engine.models.llama", "LlamaForCausalLM"),
    "phi3": ("engine.models.llama", "LlamaForCausalLM"),  # fused qkv/gate_up load whole
    "gemma2": ("engine.models.gemma", "Gemma2ForCausalLM"),
    "gemma3_text": ("engine.models.gemma", "Gemma3ForCausalLM"),
    "gemma4_text": ("engine.models.gemma4", "Gemma4ForCausalLM"),
    "olmo2": ("engine.models.olmo", "Olmo2ForCausalLM"),
    "olmo3": ("engine.models.olmo", "Olmo2ForCausalLM"),
    "qwen2_moe": ("engine.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("engine.models.mixtral", "MixtralForCausalLM"),
    "gpt_oss": ("engine.models.gpt_oss", "GptOssForCausalLM"),
    "glm4_moe": ("engine.models.glm4_moe", "Glm4MoeForCausalLM"),
    "qwen3_5_text": ("engine.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("engine.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("engine.models.qwen3_5", "Qwen3NextForCausalLM"),
    "deepseek_v3": ("engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


def supported_model_types() -> tuple[str, ...]:
    """Every ``model_type`` pagedq runs, sorted."""
    return tuple(sorted(MODEL_REGISTRY))


def model_class(config) -> type:
    """The class that runs ``config.model_type``; unknown types are refused naming the
    supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"model_type={model_type!r} is not supported: must be one of {supported_model_types()}"
        )
    module, name = MODEL_REGISTRY[model_type]
    return getattr(importlib.import_module(module), name)

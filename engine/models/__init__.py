"""The model registry: one file per family, looked up by ``config.model_type``.

Shared layers (attention with its options, rotary embeddings, norms, MLPs, the decoder block,
the causal-LM shell) live beside the family files; a family file composes them and says only
what is new in it. A family without a file runs on the Transformers modeling backend
(``engine/models/transformers/``), as ``model_impl`` chooses.
"""

from __future__ import annotations

import importlib

from engine.config import MODEL_IMPLS

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
    "gemma3n_text": ("engine.models.gemma3n", "Gemma3nForCausalLM"),
    "gemma4_unified_text": ("engine.models.gemma4", "Gemma4ForCausalLM"),
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
    "olmo_hybrid": ("engine.models.olmo_hybrid", "OlmoHybridForCausalLM"),
    "lara_mini": ("engine.models.lara_mini", "LaraMiniForCausalLM"),
    "deepseek_v3": ("engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "glm4_moe_lite": ("engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "youtu": ("engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "sarvam_mla": ("engine.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "axk1": ("engine.models.axk1", "AXK1ForCausalLM"),
    "axk2": ("engine.models.axk2", "AXK2ForCausalLM"),
    "deepseek_v32": ("engine.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("engine.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "deepseek_v2": ("engine.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "mistral4": ("engine.models.mistral4", "Mistral4ForCausalLM"),
    "minicpm3": ("engine.models.minicpm3", "MiniCPM3ForCausalLM"),
    "lfm2": ("engine.models.lfm2", "Lfm2ForCausalLM"),
    "lfm2_moe": ("engine.models.lfm2", "Lfm2MoeForCausalLM"),
    "lfm3": ("engine.models.lfm3", "Lfm3ForCausalLM"),
    "kimi_linear": ("engine.models.kimi_linear", "KimiLinearForCausalLM"),
    "bailing_hybrid": ("engine.models.bailing_hybrid", "BailingHybridForCausalLM"),
    "granitemoehybrid": ("engine.models.granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "bamba": ("engine.models.bamba", "BambaForCausalLM"),
    "nemotron_h": ("engine.models.nemotron_h", "NemotronHForCausalLM"),
    "falcon_h1": ("engine.models.falcon_h1", "FalconH1ForCausalLM"),
    "mamba2": ("engine.models.mamba2_lm", "Mamba2ForCausalLM"),
    "mamba": ("engine.models.mamba_lm", "MambaForCausalLM"),
    "falcon_mamba": ("engine.models.mamba_lm", "FalconMambaForCausalLM"),
    "jamba": ("engine.models.jamba", "JambaForCausalLM"),
    "minimax": ("engine.models.minimax", "MiniMaxForCausalLM"),
    "zamba2": ("engine.models.zamba2", "Zamba2ForCausalLM"),
    "falcon": ("engine.models.falcon", "FalconForCausalLM"),
    "gpt_neo": ("engine.models.gpt_neo", "GPTNeoForCausalLM"),
    "xglm": ("engine.models.fairseq", "FairseqDecoderForCausalLM"),
    "biogpt": ("engine.models.fairseq", "FairseqDecoderForCausalLM"),
    "openai-gpt": ("engine.models.openai_gpt", "OpenAIGPTLMHeadModel"),
    "bloom": ("engine.models.bloom", "BloomForCausalLM"),
    "mpt": ("engine.models.mpt", "MptForCausalLM"),
    "gpt_neox_japanese": ("engine.models.gpt_neox_japanese", "GPTNeoXJapaneseForCausalLM"),
    "modernbert-decoder": ("engine.models.modernbert_decoder", "ModernBertDecoderForCausalLM"),
    "diffllama": ("engine.models.diffllama", "DiffLlamaForCausalLM"),
    "dory": ("engine.models.dory", "DoryForCausalLM"),
    "mllama_text_model": ("engine.models.mllama", "MllamaForCausalLM"),
    "llama4_text": ("engine.models.llama4", "Llama4ForCausalLM"),
    "longcat_flash": ("engine.models.longcat_flash", "LongcatFlashForCausalLM"),
    "mimo_v2_flash": ("engine.models.mimo_v2_flash", "MiMoV2FlashForCausalLM"),
}


def supported_model_types() -> tuple[str, ...]:
    """Every ``model_type`` pagedq runs natively, sorted."""
    return tuple(sorted(MODEL_REGISTRY))


def model_impls() -> dict[str, str]:
    """Each claimed ``model_type`` -> the path ``model_impl="auto"`` serves it on: "native" or
    "transformers" (the backend's verified types, ``TRANSFORMERS_BACKEND_TYPES``)."""
    from engine.models.transformers import TRANSFORMERS_BACKEND_TYPES

    impls = dict.fromkeys(TRANSFORMERS_BACKEND_TYPES, "transformers")
    impls.update(dict.fromkeys(MODEL_REGISTRY, "native"))
    return dict(sorted(impls.items()))


def model_class(config, model_impl: str = "auto") -> type:
    """The class that runs ``config.model_type``: its native family ("native", or "auto" where
    the registry has one), else the Transformers backend ("transformers", or "auto" for any
    other type: the backend refuses at load what it cannot run, naming why)."""
    from engine.models.transformers import MODEL_CLASS

    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl={model_impl!r} is invalid: must be one of {MODEL_IMPLS}")
    model_type = getattr(config, "model_type", None)
    native = model_type in MODEL_REGISTRY
    if model_impl == "native" and not native:
        raise ValueError(
            f"model_type={model_type!r} has no native implementation: with "
            f"model_impl='native' it must be one of {supported_model_types()}; "
            "model_impl='auto' or 'transformers' runs it on the Transformers backend"
        )
    module, name = (
        MODEL_REGISTRY[model_type] if native and model_impl != "transformers" else MODEL_CLASS
    )
    return getattr(importlib.import_module(module), name)


def check_parallel(model: str, model_impl: str, tensor_parallel_size: int) -> None:
    """Refuse ``tensor_parallel_size`` > 1 for a model the Transformers backend would run but
    cannot split (no tensor-parallel plan in its config, heads that do not divide), before any
    rank starts; what only the built model shows is refused as each rank builds it."""
    from engine.model_loader import cached_source, load_config, resolve_model
    from engine.models.transformers.parallel import refusal

    if tensor_parallel_size == 1 or model_impl == "native":
        return
    config = load_config(cached_source(resolve_model(model)))
    if model_impl == "transformers" or config.model_type not in MODEL_REGISTRY:
        reason = refusal(config, tensor_parallel_size)
        if reason is not None:
            raise ValueError(
                f"model_impl={model_impl!r} serves model_type={config.model_type!r} on the "
                f"Transformers backend, which cannot split it over "
                f"tensor_parallel_size={tensor_parallel_size}: {reason}"
            )

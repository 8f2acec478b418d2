"""transformers' own causal LM for a config, built for pagedq: weights allocated and not filled
(every one is loaded next), attention and experts set to pagedq's implementations; and the
tensors transformers keeps in fp32 whatever the model's dtype."""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine.models.transformers import attention, experts


def build_model(config) -> nn.Module:
    """transformers' causal LM for ``config`` in fp32, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    attention.register()
    experts.register()
    config = copy.deepcopy(config)  # from_config writes into it; the engine keeps its own
    with no_init_weights():
        hf = AutoModelForCausalLM.from_config(
            config,
            attn_implementation=attention.ATTN_IMPLEMENTATION,
            experts_implementation=experts.EXPERTS_IMPLEMENTATION,
            dtype=torch.float32,
        )
    hf.tie_weights()
    return hf.eval().requires_grad_(False)


def fp32_tensors(hf: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]]:
    """``(owner, name, tensor, always)`` of each floating tensor transformers keeps in fp32: the
    rotary embeddings' buffers and ``_keep_in_fp32_modules_strict`` always,
    ``_keep_in_fp32_modules`` in an fp16 model only (as ``from_pretrained`` does)."""
    from transformers.core_model_loading import build_glob_alternation

    patterns: dict[str, bool] = {}
    for attr, always in (("_keep_in_fp32_modules", False), ("_keep_in_fp32_modules_strict", True)):
        patterns.update(dict.fromkeys(getattr(hf, attr, None) or (), always))
    regex, by_group, _ = build_glob_alternation(list(patterns)) if patterns else (None, {}, None)
    out = []
    for module_name, module in hf.named_modules():
        rotary = type(module).__name__.endswith("RotaryEmbedding")
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if not tensor.is_floating_point():
                continue
            match = regex.search(f"{module_name}.{name}") if regex is not None else None
            if rotary or match:
                out.append((module, name, tensor, rotary or patterns[by_group[match.lastgroup]]))
    return out

"""OLMo 2 and OLMo 3: Llama's block with its norms after attention and the MLP ("post": no
norm on the block's input) and QK-norm over the whole q and k projections. OLMo 3 adds sliding
layers (``layer_types``) with a RoPE setting per layer type, which the base already reads."""

from __future__ import annotations

from engine.models.attention import AttentionOptions
from engine.models.llama import LlamaForCausalLM


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 / OLMo 3."""

    norm_style = "post"

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        options = super().attention_options(layer_idx)
        options.qk_norm = "proj"
        return options

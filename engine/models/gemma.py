"""Gemma 2 and Gemma 3 (text): Llama's block with four norms (a "sandwich" around attention
and the MLP), RMSNorm scaling by ``1 + w``, embeddings scaled by ``sqrt(hidden_size)``, GeGLU,
``query_pre_attn_scalar`` as the softmax scale, sliding and global layers, and soft-capped
logits. Gemma 3 adds per-head QK-norm and its own RoPE base per layer type."""

from __future__ import annotations

from engine.models.attention import AttentionOptions
from engine.models.llama import LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: attention scores soft-capped at ``attn_logit_softcapping``, final logits at
    ``final_logit_softcapping``."""

    norm_style = "sandwich"
    unit_offset = True

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "use_bidirectional_attention=True (an embedding model) is not supported: "
                "pagedq runs causal language models"
            )
        super().__init__(config, max_position, backend)
        self.embed_scale = config.hidden_size**0.5
        self.final_logit_softcapping = config.final_logit_softcapping

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        options = super().attention_options(layer_idx)
        options.scale = self.config.query_pre_attn_scalar**-0.5
        options.logits_soft_cap = self.config.attn_logit_softcapping
        return options


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2 with per-head QK-norm (``1 + w``), a RoPE setting per layer
    type (``make_rotaries``), and no attention soft-cap by default."""

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        options = super().attention_options(layer_idx)
        options.qk_norm, options.norm_unit_offset = "head", True
        return options

"""MiniCPM3 (``minicpm3``): latent attention with plain rotate-half rope (not interleaved) and
dense SwiGLU MLPs (``deepseek_v3.py``'s block without experts), under MiniCPM's µP scales: the
embeddings times ``scale_emb``, each block's output times ``scale_depth / sqrt(layers)`` before
the residual sum, the final hidden states divided by ``hidden_size / dim_model_base`` before the
LM head."""

from __future__ import annotations

import math

import torch

from engine.models.deepseek_v3 import DeepseekV3ForCausalLM


class MiniCPM3ForCausalLM(DeepseekV3ForCausalLM):
    """MiniCPM3: dense latent-attention blocks with µP scales."""

    rope_interleave = False

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        self.embed_scale = float(config.scale_emb)

    @staticmethod
    def residual_multiplier(config) -> float:
        return config.scale_depth / math.sqrt(config.num_hidden_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Divided before the head, as transformers does (not the logits after it).
        return super().compute_logits(hidden / self.config.logits_scaling)

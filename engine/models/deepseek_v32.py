"""DeepSeek-V3.2 (``deepseek_v32``: V3.2-Exp, V3.2, V3.2-Speciale) and GLM-5 (``glm_moe_dsa``):
DeepSeek-V3's block whose latent attention runs under DeepSeek Sparse Attention
(``sparse_attention.py``: each query attends to the ``index_topk`` keys a lightning indexer
scores best). GLM-5's indexer rotates its features in interleaved pairs, V3.2's in halves."""

from __future__ import annotations

from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.sparse_attention import IndexedLatentAttention


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's block with the indexer in every layer."""

    def make_attention(self, config, backend: str) -> IndexedLatentAttention:
        interleaved = config.model_type == "glm_moe_dsa"
        return IndexedLatentAttention(config, backend, self.rope_interleave, interleaved)

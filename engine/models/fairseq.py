"""fairseq's transformer decoder as transformers ports it: XGLM (``xglm``, Meta's multilingual
564M-7.5B) and BioGPT (``biogpt``, Microsoft's biomedical 347M / 1.5B). Token embeddings scaled
by ``sqrt(hidden_size)`` (``scale_embedding``), absolute positions offset by 2 (fairseq's
padding convention) added to them: XGLM's sinusoids (sines then cosines, the row of
``pad_token_id`` zeroed), BioGPT's learned table. LayerNorm-first blocks (default eps 1e-5,
as transformers builds them), attention with biases and the usual scale, a two-matrix GeLU MLP
(``fc1``, ``fc2``), a final LayerNorm; the LM head tied to the embeddings unless the config
says otherwise. Neither calls transformers' ``AttentionInterface`` (XGLM) or names its head as
the backend expects (BioGPT's ``output_projection``): this file serves both."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.checkpoint_names import renamed
from engine.models.mlp import GeluMLP

POSITION_OFFSET = 2
# transformers' activation names -> F.gelu's ``approximate``.
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# Checkpoint names (``biogpt.`` dropped) -> ours (``checkpoint_names.renamed``).
_NAMES = (
    ("output_projection.", "lm_head."),
    ("layer_norm.", "norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".fc1.", ".mlp.dense_h_to_4h."),
    (".fc2.", ".mlp.dense_4h_to_h."),
)


def gelu_approximation(config, field: str) -> str:
    """``approximate`` for ``F.gelu`` from the config's activation ``field``; others refused."""
    name = getattr(config, field)
    if name not in GELU_APPROXIMATIONS:
        raise ValueError(
            f"{field}={name!r} is not supported for {config.model_type}: "
            f"must be one of {sorted(GELU_APPROXIMATIONS)}"
        )
    return GELU_APPROXIMATIONS[name]


def sinusoids(positions: torch.Tensor, dim: int, padding_idx: int | None) -> torch.Tensor:
    """fairseq's sinusoidal embedding rows ``positions + 2`` (fp32 ``[tokens, dim]``): sines
    then cosines of ``dim // 2`` frequencies ``10000 ** (-i / (dim // 2 - 1))``, the row
    ``padding_idx`` zero, as transformers' ``XGLMSinusoidalPositionalEmbedding`` tabulates."""
    half = dim // 2
    freq = torch.exp(
        torch.arange(half, device=positions.device).float() * -(math.log(10000) / (half - 1))
    )
    rows = positions + POSITION_OFFSET
    angles = rows.float()[:, None] * freq[None]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.nn.functional.pad(table, (0, 1))
    if padding_idx is not None:
        table = table.masked_fill((rows == padding_idx)[:, None], 0.0)
    return table


class FairseqDecoderLayer(nn.Module):
    """``x + attn(ln(x))``, then ``+ fc2(gelu(fc1(ln(x))))``; residuals added here."""

    def __init__(self, config, approximate: str, backend: str) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        ffn = getattr(config, "ffn_dim", None) or config.intermediate_size
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.self_attn = Attention(
            hidden, heads, heads, hidden // heads, backend,
            AttentionOptions(qkv_bias=True, o_bias=True),
        )  # fmt: skip
        self.final_layer_norm = nn.LayerNorm(hidden)
        self.mlp = GeluMLP(hidden, ffn, True, approximate)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        hidden = hidden + self.self_attn(None, self.self_attn_layer_norm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.final_layer_norm(hidden)), None


class FairseqDecoderForCausalLM(CausalLM):
    """XGLM and BioGPT: the decoder stack over scaled token and offset position embeddings."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        field = "activation_function" if config.model_type == "xglm" else "hidden_act"
        approximate = gelu_approximation(config, field)
        hidden = config.hidden_size
        self.token_scale = math.sqrt(hidden) if config.scale_embedding else None
        self.learned_positions = config.model_type == "biogpt"
        if self.learned_positions:
            rows = config.max_position_embeddings + POSITION_OFFSET
            self.embed_positions = nn.Embedding(rows, hidden)
        for _ in range(config.num_hidden_layers):
            layer = FairseqDecoderLayer(config, approximate, backend)
            layer.rope_key = None
            self.layers.append(layer)
        self.norm = nn.LayerNorm(hidden)

    def position_embeddings(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each token's position embedding, in the model's dtype."""
        if self.learned_positions:
            return self.embed_positions(positions + POSITION_OFFSET)
        table = sinusoids(positions, self.config.hidden_size, self.config.pad_token_id)
        return table.to(dtype)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.token_scale is not None:  # a Python float, as transformers multiplies
            hidden = hidden * self.token_scale
        return hidden + self.position_embeddings(positions, hidden.dtype)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(renamed(name.removeprefix("biogpt."), _NAMES))

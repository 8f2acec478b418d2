"""Rotary position embeddings with every scaling type transformers knows, as it computes them."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.reference import rotary_torch


def rope_parameters(config) -> dict:
    """The config's RoPE settings in one dict, for old and new transformers configs."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin cache indexed by absolute position.

    ``rotary_dim`` (partial rotary) is the number of leading features of a head that rotate;
    ``params`` overrides the config's RoPE settings (a layer type's own base, Gemma 3).
    """

    def __init__(
        self,
        config,
        head_dim: int,
        max_position: int,
        rotary_dim: int | None = None,
        params: dict | None = None,
    ) -> None:
        super().__init__()
        params = dict(params) if params is not None else rope_parameters(config)
        params.setdefault("rope_type", params.get("type", "default"))
        rope_type = params["rope_type"]
        dim = rotary_dim or head_dim
        self.rotary_dim = dim
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        else:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported: must be 'default' or one of "
                f"{sorted(ROPE_INIT_FUNCTIONS)}"
            )
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # Plain attributes, not buffers: model.to(dtype) must not round them; they stay fp32
        # and are cast per use, as Hugging Face does.
        self.cos = emb.cos() * scaling
        self.sin = emb.sin() * scaling

    def to_device(self, device: torch.device) -> None:
        """Move the fp32 cos/sin cache to ``device``."""
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate ``q`` ``[T, heads, D]`` and ``k`` ``[T, kv_heads, D]`` by their positions."""
        return rotary_torch(positions, q, k, self.cos, self.sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """``(cos, signed_sin)`` ``[T, 1, D]`` of a step, gathered once for every layer.

        ``signed_sin`` carries rotate-half's minus sign, so ``apply`` needs no negation.
        """
        half = self.cos.shape[1] // 2
        cos = self.cos[positions].to(dtype)
        sin = self.sin[positions].to(dtype)
        sin[:, :half].neg_()
        return cos.unsqueeze(1), sin.unsqueeze(1)

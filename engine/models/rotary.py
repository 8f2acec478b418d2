"""Rotary position embeddings with every scaling type transformers knows, as it computes them.

The frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn with
its attention factor, longrope, llama3, proportional), so each type is the reference's maths.
Two types depend on the sequence length as well as the position (``LENGTH_DEPENDENT``):
Hugging Face recomputes them from the length of each forward pass, so a prompt token of a
prompt of ``L`` tokens is rotated for length ``L`` and a generated token at position ``p`` for
length ``p + 1``. ``cos_sin`` takes that length per token (``rope_lengths``), which makes the
rotation independent of how the engine chunks, batches or recomputes the sequence.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.reference import rotary_torch

LENGTH_DEPENDENT = ("dynamic", "longrope")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Features that rotate in adjacent pairs (x0, x1), (x2, x3)... (DeepSeek's and Llama 4's
    complex rotary) laid out [evens | odds], so that rotate-half's halves are the pairs; the dot
    products of a q and a k laid out alike are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def is_per_layer_type(config) -> bool:
    """True when ``rope_parameters`` holds one entry per layer type (Gemma 3, OLMo 3). A
    type may have no layer: a Gemma 3 config read from GGUF keeps both entries with the
    default layer pattern, all sliding for a model of fewer than six layers."""
    params = getattr(config, "rope_parameters", None) or {}
    types = set(getattr(config, "layer_types", None) or ())
    return bool(params) and bool(types) and all(isinstance(v, dict) for v in params.values())


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's RoPE settings in one dict (a layer type's own where it has them), for old
    and new transformers configs."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and is_per_layer_type(config):
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_key(config, layer_idx: int) -> str:
    """Which rotary embedding layer ``layer_idx`` uses: its layer type where the config has
    one RoPE setting per type, else "default"."""
    return config.layer_types[layer_idx] if is_per_layer_type(config) else "default"


def make_rotaries(config, head_dim: int, max_position: int) -> dict[str, RotaryEmbedding]:
    """One rotary embedding per RoPE setting of the config, keyed as ``rope_key`` names them."""
    if is_per_layer_type(config):
        return {
            t: RotaryEmbedding(config, head_dim, max_position, layer_type=t)
            for t in config.rope_parameters
        }
    return {"default": RotaryEmbedding(config, head_dim, max_position)}


# Positions tabulated at first: a whole table of a 10M-position model (Llama 4 Scout) would be
# 10 GB of fp32 cos and sin; it grows as longer sequences come.
INITIAL_POSITIONS = 8192


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cos/sin cache indexed by absolute position.

    ``rotary_dim`` (partial rotary: the leading features of a head that rotate) follows the
    config's ``partial_rotary_factor`` unless given; ``layer_type`` picks that type's settings
    (Gemma 3).
    """

    def __init__(
        self,
        config,
        head_dim: int,
        max_position: int,
        rotary_dim: int | None = None,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        self.rope_type = rope_type = params["rope_type"]
        self.config, self.layer_type = config, layer_type
        if rope_type == "default":
            factor = params.get("partial_rotary_factor")
            if factor is None:
                factor = getattr(config, "partial_rotary_factor", None) or 1.0
            dim = rotary_dim or int(head_dim * factor)
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            self.scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, self.scaling = self._init_fn()
        else:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported: must be 'default' or one of "
                f"{sorted(ROPE_INIT_FUNCTIONS)}"
            )
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.length_dependent = rope_type in LENGTH_DEPENDENT
        self.max_position, self.inv_freq = max_position, inv_freq
        rows = min(max_position, INITIAL_POSITIONS)
        if rope_type == "longrope":
            # Past the pretraining length every token rotates with the long factors.
            self.threshold = int(params["original_max_position_embeddings"])
            self.long_inv_freq, _ = self._init_fn(seq_len=self.threshold + 1)
            self.long_cos, self.long_sin = self._table(self.long_inv_freq, rows)
        elif rope_type == "dynamic":
            self.threshold = int(config.max_position_embeddings)
        self.cos, self.sin = self._table(inv_freq, rows)

    def _init_fn(self, **kwargs):
        if self.layer_type is not None:
            kwargs["layer_type"] = self.layer_type
        return ROPE_INIT_FUNCTIONS[self.rope_type](self.config, "cpu", **kwargs)

    def _table(self, inv_freq: torch.Tensor, max_position: int):
        # Plain attributes, not buffers: model.to(dtype) must not round them; they stay fp32
        # and are cast per use, as Hugging Face does.
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def _cover(self, positions: torch.Tensor) -> None:
        """Grow the tables (doubling, to ``max_position`` at most) to cover ``positions``: the
        same fp32 values a whole table would hold."""
        rows = self.cos.shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need <= rows or rows >= self.max_position:
            return
        rows, device = min(self.max_position, max(need, 2 * rows)), self.cos.device
        self.cos, self.sin = (t.to(device) for t in self._table(self.inv_freq, rows))
        if self.rope_type == "longrope":
            tables = self._table(self.long_inv_freq, rows)
            self.long_cos, self.long_sin = (t.to(device) for t in tables)

    def to_device(self, device: torch.device) -> None:
        """Move the fp32 cos/sin caches to ``device``."""
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        if self.rope_type == "longrope":
            self.long_cos, self.long_sin = self.long_cos.to(device), self.long_sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate ``q`` ``[T, heads, D]`` and ``k`` ``[T, kv_heads, D]`` by their positions."""
        self._cover(positions)
        return rotary_torch(positions, q, k, self.cos, self.sin)

    def cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        rope_lengths: torch.Tensor | None = None,
    ):
        """``(cos, signed_sin)`` ``[T, 1, D]`` of a step, gathered once for every layer.

        ``signed_sin`` carries rotate-half's minus sign, so ``apply`` needs no negation.
        ``rope_lengths`` (a length-dependent type only): the sequence length each token's
        frequencies are computed for.
        """
        self._cover(positions)
        cos, sin = self.cos[positions], self.sin[positions]
        if self.length_dependent and rope_lengths is not None:
            cos, sin = self._length_dependent(positions, rope_lengths, cos, sin)
        half = cos.shape[1] // 2
        cos, sin = cos.to(dtype), sin.to(dtype)
        sin[:, :half].neg_()
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _length_dependent(self, positions, lengths, cos, sin):
        beyond = lengths > self.threshold
        if not bool(beyond.any()):
            return cos, sin
        if self.rope_type == "longrope":
            pick = beyond[:, None]
            return (
                torch.where(pick, self.long_cos[positions], cos),
                torch.where(pick, self.long_sin[positions], sin),
            )
        cos, sin = cos.clone(), sin.clone()
        for length in lengths[beyond].unique().tolist():
            rows = lengths == length
            # A tensor length, as Hugging Face passes it: the same float32 arithmetic.
            inv_freq, _ = self._init_fn(seq_len=torch.tensor(length))
            freqs = positions[rows].float()[:, None] * inv_freq.to(cos.device)[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            cos[rows], sin[rows] = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos, sin

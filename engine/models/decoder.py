"""A transformer block: attention and a feed-forward block, each with its residual, and the
norm placements families use ("pre": Llama; "sandwich": Gemma's four norms; "post": OLMo 2)."""

from __future__ import annotations

from torch import nn

from engine.models.norm import RMSNorm

NORM_STYLES = ("pre", "sandwich", "post")


class DecoderLayer(nn.Module):
    """``self_attn`` and ``mlp`` (dense or mixture of experts) with residuals.

    "pre" fuses each residual add into the next norm (one C++ pass on the CPU) and hands the
    residual stream on to the next layer, in fp32 whatever the model's dtype: a bf16 stream is
    rounded at every add, 2 x layers times, and drifts from fp32 further than Hugging Face's
    bf16 (bench/fidelity.py). The other styles add it where the family does.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        backend: str,
        norm_style: str = "pre",
        unit_offset: bool = False,
        residual_multiplier: float | None = None,
    ) -> None:
        super().__init__()
        if norm_style not in NORM_STYLES:
            raise ValueError(f"norm_style={norm_style!r}: must be one of {NORM_STYLES}")
        self.self_attn, self.mlp, self.norm_style = self_attn, mlp, norm_style
        if residual_multiplier is not None and norm_style != "pre":
            raise ValueError("residual_multiplier is supported with norm_style='pre' only")
        self.residual_multiplier = residual_multiplier  # Granite: residual + m * block(x)

        def norm() -> RMSNorm:
            return RMSNorm(hidden_size, eps, backend, unit_offset)

        if norm_style != "post":
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if norm_style == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if norm_style != "pre":
            self.post_feedforward_layernorm = norm()

    def _scaled(self, out):
        m = self.residual_multiplier
        return out if m is None else out * m

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """``(block output, residual stream)``; ``residual`` is None before the first layer
        and after every layer of a style that adds its own residuals."""
        if self.norm_style == "pre":
            if residual is None:
                residual, hidden = hidden.float(), self.input_layernorm(hidden)
            else:
                hidden, residual = self.input_layernorm(hidden, residual)
            hidden = self._scaled(self.self_attn(rope, hidden, kv_cache, meta))
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self._scaled(self.mlp(hidden)), residual
        if residual is not None:  # the stream a "pre" layer before this one handed on
            hidden = (hidden + residual).to(hidden.dtype)
        if self.norm_style == "sandwich":
            attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
            hidden = hidden + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
            return hidden + self.post_feedforward_layernorm(mlp), None
        attn = self.self_attn(rope, hidden, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden)), None

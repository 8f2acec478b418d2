"""TII's Falcon-H1 (``falcon_h1``): parallel hybrid blocks. Each layer runs a Mamba-2 mixer
(engine/models/mamba2.py) and full attention side by side on the same normed input, adds their
outputs to the residual, then a SwiGLU MLP with its own norm and residual:

    h = norm(x);  x = x + m_ssm * mamba(h) + m_out * attn(m_in * h);  x = x + mlp(norm(x))

so every layer keeps both paged KV and a state slot per sequence.

Falcon-H1's µP multipliers, where transformers applies them: embeddings times
``embedding_multiplier``, logits times ``lm_head_multiplier``; the Mamba input times
``ssm_in_multiplier`` and its projection ``[z | x | B | C | dt]`` times the five
``ssm_multipliers``; keys times ``key_multiplier`` (folded into ``k_proj`` at load); the MLP's
gate times ``mlp_multipliers[0]`` (folded into ``gate_proj``) and its output times
``mlp_multipliers[1]``. The Mamba output is gated by ``silu(z)``, with a grouped RMSNorm
before or after the gate where ``mamba_rms_norm`` is set.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import Attention, AttentionOptions
from engine.models.causal_lm import CausalLM
from engine.models.config_fields import head_dim_of, num_kv_heads_of
from engine.models.mamba2 import Mamba2Mixer
from engine.models.mlp import GatedMLP
from engine.models.norm import RMSNorm
from engine.models.rotary import RotaryEmbedding


class FalconH1Mamba(Mamba2Mixer):
    """The Mamba-2 mixer with Falcon-H1's input multiplier and per-segment µP vector."""

    def __init__(self, config, backend: str) -> None:
        hidden = config.hidden_size
        inner = config.mamba_d_ssm or int(config.mamba_expand * hidden)
        if inner != config.mamba_n_heads * config.mamba_d_head:
            raise ValueError(
                f"mamba_d_ssm={inner} must be mamba_n_heads * mamba_d_head = "
                f"{config.mamba_n_heads * config.mamba_d_head}"
            )
        if config.mamba_rms_norm:
            norm = "norm_then_gate" if config.mamba_norm_before_gate else "gated"
        else:
            norm = None
        super().__init__(
            hidden, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
            config.mamba_d_state, config.mamba_d_conv, config.rms_norm_eps, backend,
            conv_bias=bool(config.mamba_conv_bias), proj_bias=bool(config.projectors_bias),
            time_step_limit=tuple(config.time_step_limit or (0.0, float("inf"))), norm=norm,
        )  # fmt: skip
        bc = self.n_groups * self.d_state
        sizes = [self.inner, self.inner, bc, bc, self.num_heads]  # this rank's segments
        mup = torch.cat([torch.full((n,), float(m)) for n, m in
                         zip(sizes, config.ssm_multipliers, strict=True)])  # fmt: skip
        self.register_buffer("mup_vector", mup, persistent=False)
        self.in_multiplier = float(config.ssm_in_multiplier)

    def project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.in_proj(hidden * self.in_multiplier) * self.mup_vector.to(hidden.dtype)


class FalconH1DecoderLayer(nn.Module):
    """Mamba-2 and attention in parallel, then the MLP; the residual stream in fp32 as the
    other pre-norm layers keep it (engine/models/decoder.py)."""

    def __init__(self, config, backend: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.mamba = FalconH1Mamba(config, backend)
        bias = bool(config.attention_bias)
        self.self_attn = Attention(
            hidden, config.num_attention_heads, num_kv_heads_of(config), head_dim_of(config),
            backend, AttentionOptions(qkv_bias=bias, o_bias=bias),
        )  # fmt: skip
        self.feed_forward = GatedMLP(hidden, config.intermediate_size, backend, config.mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps, backend)
        self.pre_ff_layernorm = RMSNorm(hidden, eps, backend)
        self.ssm_out = float(config.ssm_out_multiplier)
        self.attn_in = float(config.attention_in_multiplier)
        self.attn_out = float(config.attention_out_multiplier)
        self.down_multiplier = float(config.mlp_multipliers[1])
        self.rope_key = "default"

    def forward(self, rope, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden.float(), self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        ssm = self.mamba(rope, hidden, None, meta) * self.ssm_out
        attn = self.self_attn(rope, hidden * self.attn_in, kv_cache, meta) * self.attn_out
        hidden, residual = self.pre_ff_layernorm(ssm + attn, residual)
        return self.feed_forward(hidden) * self.down_multiplier, residual


class FalconH1ForCausalLM(CausalLM):
    """Falcon-H1's stack; each layer's Mamba state is a slot of the state cache."""

    def __init__(self, config, max_position: int, backend: str = "auto") -> None:
        super().__init__(config, max_position, backend)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: must be 'silu'")
        self.rotaries["default"] = RotaryEmbedding(config, head_dim_of(config), max_position)
        for _ in range(config.num_hidden_layers):
            self.layers.append(FalconH1DecoderLayer(config, backend))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        if config.embedding_multiplier != 1.0:
            self.embed_scale = float(config.embedding_multiplier)
        if config.lm_head_multiplier != 1.0:
            self.logits_scale = float(config.lm_head_multiplier)

    def recurrent_state_specs(self):
        """Every layer's Mamba state, in order."""
        return [layer.mamba.state_spec() for layer in self.layers]

    def bind_state_cache(self, cache) -> None:
        """Point every layer's Mamba mixer at its pools of ``cache``."""
        for j, layer in enumerate(self.layers):
            layer.mamba.bind_state(cache.conv_states[j], cache.ssm_states[j])

    def checkpoint_name(self, name: str) -> str | None:
        if name == "final_layernorm.weight":
            return "norm.weight"
        return super().checkpoint_name(name)

    def load_weights(self, weights) -> None:
        super().load_weights((name, self._fold(name, t)) for name, t in weights)

    def _fold(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Key and MLP-gate multipliers folded into their projections."""
        c = self.config
        if ".self_attn.k_proj." in name and c.key_multiplier != 1.0:
            return tensor * c.key_multiplier
        if ".feed_forward.gate_proj." in name and c.mlp_multipliers[0] != 1.0:
            return tensor * c.mlp_multipliers[0]
        return tensor
